"""``RUN/evals.jsonl``: one line per eval metric, whoever evaluated — the training loop's
in-loop evals and ``goodput eval`` on a checkpoint alike — so a run's evals read as one table.

A line is a ``runfiles.EvalLine`` (``step``, the optimizer step of the weights evaluated, then
``task``, ``metric``, ``value``, ``stderr``, ``source`` and ``time``), non-finite values as null
(strict JSON). One evaluation's lines go in one ``write`` of an append-mode file, flushed and
synced, so a crash leaves whole lines before it; a reader skips a torn last line.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from goodput import rundir
from goodput.io import open_append
from goodput.runfiles import EvalLine, evals_text


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
        EvalLine(
            step=step,
            task=record.task,
            metric=record.metric,
            value=record.value,
            stderr=record.stderr,
            source=source,
            time=now,
        )
        for record in records
    ]
    if not lines:
        return
    with open_append(path) as out:
        out.write(evals_text(lines, where=path))
        out.flush()
        os.fsync(out.fileno())
