"""Everything a run directory says about where its time went, read strictly: the report's only
input (``goodput report`` reads nothing else, and writes nothing into the run).

Owns ``read_run`` (a run directory -> ``RunFiles``) and ``Step`` (one ``metrics.jsonl`` line).

Read: ``metrics.jsonl`` (every job's and attempt's steps, appended: a step recomputed after a
failure appears again), ``evals.jsonl``, ``attempts.jsonl`` (``launch.history.read_attempts``:
every ``goodput launch --run-dir`` attempt, across the jobs of a chain), ``run.json``, the
complete checkpoints (``rundir.list_checkpoints``), the ``done`` marker, the blend's mixture
report (``blend.json`` of the blend ``run.json`` names, when it is still there) and
``lr_find.json``. Missing files are fine (a run that never launched, a run not yet evaluated);
a file that is there must be a regular file and parse. The JSONL files are read line by line
(``io.read_json_lines``) with a bound on each line: a line past ``rundir.MAX_LINE_BYTES``, a
line that is not an object of the expected fields, or a value that is not a finite number where
one belongs is one ``GoodputError`` naming ``FILE:LINE``. A last line without its newline (the
writer was killed mid-write) is left out, as a reader of a live file must.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from goodput import rundir
from goodput.errors import GoodputError
from goodput.io import read_json, read_json_lines
from goodput.launch.history import AttemptRecord, read_attempts

MAX_LINES = 10_000_000  # a metrics file past this is not one run's
MAX_TOKENS = float(1 << 62)  # a step's tokens, capped (the accounting leaves such a step out)
FIX = "it is not what goodput wrote; restore it or move it out of the run directory"
# The step record's fields the report reads, beside the series it plots (``Step.values``).
STEP_TIMES = ("data_time_s", "checkpoint_stall_s", "checkpoint_load_s", "startup_s", "eval_time_s")


@dataclass(frozen=True, slots=True)
class Step:
    """One step record: ``time`` is when it ended (seconds since the epoch); the ``*_s`` parts
    of ``step_time_s`` the trainer measured (0 where it did not say)."""

    step: int
    time: float
    step_time_s: float
    tokens: int  # tokens per step (tokens_per_s x step_time_s, rounded)
    data_time_s: float = 0.0
    checkpoint_stall_s: float = 0.0
    checkpoint_load_s: float = 0.0
    startup_s: float | None = None  # only on the first step of a process
    eval_time_s: float = 0.0  # after the step, outside step_time_s, before ``time``
    values: dict[str, float] = field(default_factory=dict)  # every finite number of the line
    line: int = 0  # its line in metrics.jsonl (what the accounting names when it leaves it out)


@dataclass(frozen=True, slots=True)
class EvalLine:
    step: int
    task: str
    metric: str
    value: float | None
    stderr: float | None
    source: str


@dataclass(frozen=True, slots=True)
class RunFiles:
    run_dir: Path
    steps: list[Step]
    evals: list[EvalLine]
    attempts: list[AttemptRecord]
    record: dict[str, Any] | None  # run.json
    checkpoint_steps: list[int]  # complete checkpoints, oldest first
    done: bool
    mixture: list[dict[str, Any]] | None  # the blend report's rows: corpus, target, achieved
    lr_find: dict[str, Any] | None  # lr_find.json as goodput diagnose lr-find wrote it


def read_run(run_dir: Path) -> RunFiles:
    if not run_dir.is_dir():
        raise GoodputError.usage(run_dir, "no such run directory", "pass a train.run_dir")
    metrics = run_dir / rundir.METRICS
    attempts = run_dir / rundir.ATTEMPTS
    if not os.path.lexists(metrics) and not os.path.lexists(attempts):
        raise GoodputError.usage(
            run_dir,
            f"holds neither {rundir.METRICS} nor {rundir.ATTEMPTS}: no run to report",
            "pass the train.run_dir (or goodput launch --run-dir) of a run that started",
        )
    record = _optional_json(run_dir / rundir.RUN_RECORD)
    return RunFiles(
        run_dir=run_dir,
        steps=[_step(raw, where) for raw, where in _json_lines(metrics)],
        evals=[_eval(raw, where) for raw, where in _json_lines(run_dir / rundir.EVALS)],
        attempts=read_attempts(attempts) if os.path.lexists(attempts) else [],
        record=record if isinstance(record, dict) else None,
        checkpoint_steps=[
            c.step for c in rundir.list_checkpoints(rundir.checkpoints_dir(run_dir)) if c.complete
        ],
        done=(run_dir / rundir.DONE).is_file(),
        mixture=_mixture(record),
        lr_find=_lr_find(run_dir / rundir.LR_FIND),
    )


def _json_lines(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    """(object, "FILE:LINE") of every whole line of ``path`` (none when it is absent; one that
    is there but is no regular file, a FIFO say, is refused, never waited on)."""
    if not os.path.lexists(path):
        return
    lines = read_json_lines(path, rundir.MAX_LINE_BYTES, fix=FIX, max_lines=MAX_LINES)
    for where, raw in lines:
        yield raw, where


def _number(raw: dict[str, Any], key: str, where: str, *, default: float | None = None) -> float:
    value: Any = raw.get(key, default)
    if value is None and default is not None:
        return default
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise GoodputError(where, f"{key!r} is {_shown(value)}, not a finite number >= 0", FIX)
    return float(value)


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)  # not bool, a subclass of int


def _count(raw: dict[str, Any], key: str, where: str) -> int:
    value = raw.get(key)
    if type(value) is not int or not 0 <= value < 1 << 62:
        raise GoodputError(where, f"{key!r} is {_shown(value)}, not a whole number >= 0", FIX)
    return value


def _step(raw: dict[str, Any], where: str) -> Step:
    step = _count(raw, "step", where)
    step_time = _number(raw, "step_time_s", where)
    tokens_per_s = _number(raw, "tokens_per_s", where, default=0.0)
    parts = {key: _number(raw, key, where, default=0.0) for key in STEP_TIMES}
    values = {
        key: float(value)
        for key, value in raw.items()
        if type(value) in (int, float) and math.isfinite(value)
    }
    return Step(
        step=step,
        time=_number(raw, "time", where),
        step_time_s=step_time,
        tokens=round(min(tokens_per_s * step_time, MAX_TOKENS)),  # inf: 1e300 x 1e300
        data_time_s=parts["data_time_s"],
        checkpoint_stall_s=parts["checkpoint_stall_s"],
        checkpoint_load_s=parts["checkpoint_load_s"],
        startup_s=parts["startup_s"] if "startup_s" in raw else None,
        eval_time_s=parts["eval_time_s"],
        values=values,
        line=int(where.rpartition(":")[2]),  # where: "FILE:LINE"
    )


def _eval(raw: dict[str, Any], where: str) -> EvalLine:
    texts = {key: raw.get(key) for key in ("task", "metric", "source")}
    for key, text in texts.items():
        if not isinstance(text, str) or not 0 < len(text) <= 200:
            raise GoodputError(where, f"{key!r} is {_shown(text)}, not a name", FIX)
    numbers = {}
    for key in ("value", "stderr"):
        value = raw.get(key)
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):
            raise GoodputError(where, f"{key!r} is {_shown(value)}, not a number or null", FIX)
        numbers[key] = None if value is None else float(value)
    return EvalLine(
        _count(raw, "step", where),
        str(texts["task"]),
        str(texts["metric"]),
        numbers["value"],
        numbers["stderr"],
        str(texts["source"]),
    )


def _optional_json(path: Path) -> Any:
    return read_json(path) if os.path.lexists(path) else None


def _mixture(record: Any) -> list[dict[str, Any]] | None:
    """The blend's report rows (target and achieved share per corpus), when the blend named by
    ``run.json`` is still where it was built and checks out."""
    from goodput.data.manifest import read_run_manifest

    data = record.get("data") if isinstance(record, dict) else None
    blend = data.get("blend") if isinstance(data, dict) else None
    if not isinstance(blend, str) or not (Path(blend) / "blend.json").is_file():
        return None
    manifest = read_run_manifest(Path(blend) / "blend.json")
    return [
        {"corpus": row["corpus"], "target": row["target"], "achieved": row["achieved"]}
        for row in manifest["report"]["corpora"]
    ]


def _lr_find(path: Path) -> dict[str, Any] | None:
    """``lr_find.json``'s curve as ``{"lr": [...], "loss": [...], "suggested_lr": x}`` (the
    points whose LR and smoothed loss are finite)."""
    if not os.path.lexists(path):
        return None
    found = read_json(path)
    curve = found.get("curve") if isinstance(found, dict) else None
    if not isinstance(curve, list) or not all(isinstance(p, dict) for p in curve):
        raise GoodputError(path, "is not what goodput diagnose lr-find writes", FIX)
    points = [(p.get("lr"), p.get("smoothed_loss")) for p in curve]
    points = [
        (float(lr), float(loss))
        for lr, loss in points
        if isinstance(lr, int | float) and isinstance(loss, int | float)
        and math.isfinite(lr) and math.isfinite(loss) and lr > 0
    ]  # fmt: skip
    suggested = found.get("suggested_lr")
    return {
        "lr": [float(lr) for lr, _ in points],
        "loss": [float(loss) for _, loss in points],
        "suggested_lr": float(suggested) if type(suggested) in (int, float) else None,
    }


def _shown(value: Any) -> str:
    return (
        json.dumps(value)[:60]
        if isinstance(value, str | int | float | bool)
        else type(value).__name__
    )
