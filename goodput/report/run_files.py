"""Everything a run directory says about where its time went, read strictly: the report's only
input (``goodput report`` reads nothing else, and writes nothing into the run).

Owns ``read_run`` (a run directory -> ``RunFiles``) and ``Step`` (one ``metrics.jsonl`` line).

Read: ``metrics.jsonl`` (every job's and attempt's steps, appended: a step recomputed after a
failure appears again), ``evals.jsonl``, ``attempts.jsonl`` (``launch.history.read_attempts``:
every ``goodput launch --run-dir`` attempt, across the jobs of a chain), ``run.json``, the
complete checkpoints (``rundir.list_checkpoints``), the ``done`` marker, the blend's mixture
report (``blend.json`` of the blend ``run.json`` names, when it is still there) and each data-mix
stage's (``run.json``'s own record of them, ``runfiles.read_stage_mixtures``),
``lr_find.json`` and ``busy.jsonl`` (busy time over ranks and the slowest ranks, a line per
straggler-watch window, read by its schema's reader ``runfiles.read_busy``). Missing files are
fine (a run that never launched, a run not yet evaluated); a file that is there must be a
regular file and parse.
``metrics.jsonl`` and ``evals.jsonl`` are read by their schema's reader (``runfiles.read_steps``,
``runfiles.read_evals``: strict and bounded, one ``GoodputError`` naming ``FILE:LINE``, a torn
last line left out); a step line must have ``step``, ``step_time_s`` and ``time``, and a part of
the step time it lacks is 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from goodput import rundir, runfiles
from goodput.errors import GoodputError
from goodput.io import is_folder, read_json
from goodput.launch.history import AttemptRecord, read_attempts
from goodput.runfiles import BusyLine, EvalLine, StageMixture, read_stage_mixtures

MAX_TOKENS = float(1 << 62)  # a step's tokens, capped (the accounting leaves such a step out)
# The step record's fields the report reads, beside the series it plots (``Step.values``).
STEP_TIMES = ("data_time_s", "checkpoint_stall_s", "snapshot_stall_s", "checkpoint_load_s",
              "startup_s", "eval_time_s")  # fmt: skip
TOKENS = "tokens"  # the step line's key: the run's tokens through the step
REQUIRED = ("step_time_s", "time")  # of every step line (its kinds: runfiles.STEP_KEYS)


@dataclass(frozen=True, slots=True)
class Step:
    """One step record: ``time`` is when it ended (seconds since the epoch); the ``*_s`` parts
    of ``step_time_s`` the trainer measured (0 where it did not say); a resumed process's first
    step says where its state came from (``runfiles.RESUMED_FROM``) and which step's it was."""

    step: int
    time: float
    step_time_s: float
    tokens: int  # tokens per step (tokens_per_s x step_time_s, rounded)
    # The run's tokens through this step, the line's ``tokens`` (None: an older trainer's line):
    # an integer, exact past 2**53 where a float of it (``values``) is not.
    tokens_seen: int | None = None
    data_time_s: float = 0.0
    checkpoint_stall_s: float = 0.0
    snapshot_stall_s: float = 0.0  # a snapshot's copy, and the wait for the one before
    checkpoint_load_s: float = 0.0
    startup_s: float | None = None  # only on the first step of a process
    eval_time_s: float = 0.0  # after the step, outside step_time_s, before ``time``
    resumed_from: str | None = None  # snapshot, partner or checkpoint; None: not said
    resumed_step: int | None = None
    values: dict[str, float] = field(default_factory=dict)  # every finite number of the line
    line: int = 0  # its line in metrics.jsonl (what the accounting names when it leaves it out)


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
    busy: list[BusyLine] = field(default_factory=list)  # busy.jsonl's windows, in order
    # run.json's data-mix stages with each one's mixture, in order ([]: an older run's record)
    stages: list[StageMixture] = field(default_factory=list)


def read_run(run_dir: Path) -> RunFiles:
    if not is_folder(run_dir):  # a loop of links is named as one, not as missing
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
        steps=_steps(metrics),
        evals=_evals(run_dir / rundir.EVALS),
        attempts=read_attempts(attempts) if os.path.lexists(attempts) else [],
        record=record if isinstance(record, dict) else None,
        checkpoint_steps=[
            c.step for c in rundir.list_checkpoints(rundir.checkpoints_dir(run_dir)) if c.complete
        ],
        done=(run_dir / rundir.DONE).is_file(),
        mixture=_mixture(record),
        lr_find=_lr_find(run_dir / rundir.LR_FIND),
        busy=_busy(run_dir / rundir.BUSY),
        stages=read_stage_mixtures(record, str(run_dir / rundir.RUN_RECORD)),
    )


def _steps(path: Path) -> list[Step]:
    if not os.path.lexists(path):
        return []
    return [_step(line) for line in runfiles.read_steps(path, require=REQUIRED)]


def _step(line: runfiles.StepLine) -> Step:
    # The keys read here are of finite kinds (runfiles.STEP_KEYS): a number of the line is one
    # of ``values``, or null or absent (0).
    values = line.numbers()
    step_time = values.get("step_time_s", 0.0)
    tokens_per_s = values.get("tokens_per_s", 0.0)
    parts = {key: values.get(key, 0.0) for key in STEP_TIMES}
    return Step(
        step=line.step,
        time=values.get("time", 0.0),
        step_time_s=step_time,
        tokens=round(min(tokens_per_s * step_time, MAX_TOKENS)),  # inf: 1e300 x 1e300
        tokens_seen=line.raw.get(TOKENS),  # its kind: runfiles.COUNT, an int
        data_time_s=parts["data_time_s"],
        checkpoint_stall_s=parts["checkpoint_stall_s"],
        snapshot_stall_s=parts["snapshot_stall_s"],
        checkpoint_load_s=parts["checkpoint_load_s"],
        startup_s=parts["startup_s"] if "startup_s" in line.raw else None,
        eval_time_s=parts["eval_time_s"],
        resumed_from=line.raw.get("resumed_from"),  # its kind: one of runfiles.RESUMED_FROM
        resumed_step=line.raw.get("resumed_step"),
        values=values,
        line=line.line,
    )


def _evals(path: Path) -> list[EvalLine]:
    return list(runfiles.read_evals(path)) if os.path.lexists(path) else []


def _busy(path: Path) -> list[BusyLine]:
    return list(runfiles.read_busy(path)) if os.path.lexists(path) else []


def _optional_json(path: Path) -> Any:
    return read_json(path) if os.path.lexists(path) else None


def _mixture(record: Any) -> list[dict[str, Any]] | None:
    """The blend's report rows (target and achieved share per corpus), when the blend named by
    ``run.json`` is still where it was built and checks out; a share outside [0, 1] is a
    ``GoodputError`` naming the blend's file."""
    from goodput.data.index_files import rebuild_fix
    from goodput.data.manifest import read_run_manifest

    data = record.get("data") if isinstance(record, dict) else None
    blend = data.get("blend") if isinstance(data, dict) else None
    if not isinstance(blend, str) or not (Path(blend) / "blend.json").is_file():
        return None
    path = Path(blend) / "blend.json"
    manifest = read_run_manifest(path)
    rows = []
    for row in manifest["report"]["corpora"]:
        for key in ("target", "achieved"):
            if not runfiles.SHARE.admits(row[key]):
                what = f"report: corpus {row['corpus']!r}: {key} is {row[key]!r}, not a share"
                raise GoodputError(path, what, rebuild_fix(path.parent))
        rows.append({"corpus": row["corpus"], "target": row["target"], "achieved": row["achieved"]})
    return rows


def _lr_find(path: Path) -> dict[str, Any] | None:
    """``lr_find.json``'s curve as ``{"lr": [...], "loss": [...], "suggested_lr": x}`` (the
    points whose LR is a finite number > 0 and smoothed loss a finite number; the suggestion
    when it is such an LR, else None)."""
    if not os.path.lexists(path):
        return None
    found = read_json(path)
    curve = found.get("curve") if isinstance(found, dict) else None
    if not isinstance(curve, list) or not all(isinstance(p, dict) for p in curve):
        raise GoodputError(path, "is not what goodput diagnose lr-find writes", runfiles.FIX)
    points = [(p.get("lr"), p.get("smoothed_loss")) for p in curve]
    points = [
        (float(lr), float(loss))
        for lr, loss in points
        if runfiles.POSITIVE.admits(lr) and runfiles.FINITE.admits(loss)
    ]
    suggested = found.get("suggested_lr")
    return {
        "lr": [lr for lr, _ in points],
        "loss": [loss for _, loss in points],
        "suggested_lr": float(suggested) if runfiles.POSITIVE.admits(suggested) else None,
    }
