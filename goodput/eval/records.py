"""``RUN/evals.jsonl``: one line per eval metric, whoever evaluated — the training loop's
in-loop evals and ``goodput eval`` on a checkpoint alike — so a run's evals read as one table.

A line is ``{"step", "task", "metric", "value", "stderr", "source", "time"}``: ``step`` the
optimizer step of the weights evaluated, ``task`` a held-out corpus (``heldout/<corpus>``), a
multiple-choice task or an lm-eval task, ``stderr`` null where the metric has none, ``source``
``"train"`` (the loop) or ``"goodput eval"``. Non-finite values are written as null (strict
JSON). One evaluation's lines go in one ``write`` of an append-mode file, flushed and synced,
so a crash leaves whole lines before it; a reader skips a torn last line.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from goodput import rundir
from goodput.io import json_text, open_append


@dataclass(frozen=True, slots=True)
class EvalRecord:
    task: str
    metric: str
    value: float
    stderr: float | None = None


def append_evals(run_dir: Path, step: int, records: Iterable[EvalRecord], source: str) -> None:
    """Append ``records`` of the weights of ``step`` to ``run_dir/evals.jsonl``."""
    now = time.time()
    path = run_dir / rundir.EVALS
    lines = [
        json_text(
            {
                "step": step,
                "task": record.task,
                "metric": record.metric,
                "value": _finite(record.value),
                "stderr": _finite(record.stderr),
                "source": source,
                "time": now,
            },
            where=path,
        )
        + "\n"
        for record in records
    ]
    if not lines:
        return
    with open_append(path) as out:
        out.write("".join(lines))
        out.flush()
        os.fsync(out.fileno())


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)
