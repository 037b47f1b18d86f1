"""Synthetic run directories with known times: what ``goodput report``'s arithmetic is checked on
(tests) and timed on (``python -m benchmarks report``). Each ``Attempt`` becomes an
``attempts.jsonl`` record written by the launcher's own writer and its steps' ``metrics.jsonl``
lines as the trainer writes them, at exactly the times it says."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from goodput import rundir
from goodput.io import write_marker
from goodput.launch.history import AttemptRecord, Evidence, Recovery, append_record, timestamp

TOKENS_PER_STEP = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class Attempt:
    """An attempt that starts at ``start`` (epoch seconds), runs ``startup_s`` (the checkpoint
    load included), then ``steps`` of ``step_time_s`` each, then ``tail_s`` until it ends."""

    start: float
    startup_s: float
    steps: range
    step_time_s: float = 1.0
    data_time_s: float = 0.0
    checkpoint_load_s: float = 0.0
    stalls: dict[int, float] = field(default_factory=dict)  # step -> checkpoint stall in it
    snapshot_stalls: dict[int, float] = field(default_factory=dict)  # step -> snapshot stall
    resumed: tuple[str, int] | None = None  # (resumed_from, resumed_step) of its first step
    evals: dict[int, float] = field(default_factory=dict)  # step -> eval seconds after it
    tail_s: float = 0.0
    class_: str = "success"
    exit_code: int = 0
    timed_out: bool = False
    job: str | None = None
    wait_s: float | None = None  # None: the last attempt (a stop)
    evidence: tuple[Evidence, ...] = ()
    replaced: dict[str, str] = field(default_factory=dict)
    host: str = "nid0001"
    # Every host in rank order (the replaced ones among them); (): ``host`` and those replaced.
    hosts: tuple[str, ...] = ()
    recovery: Recovery | None = None  # it began by recovering the one before in process

    def step_ends(self) -> list[float]:
        """Each step record's ``time``: as the trainer writes it, after the step's eval."""
        ends, clock = [], self.start + self.startup_s
        for step in self.steps:
            clock += self.step_time_s + self.evals.get(step, 0.0)
            ends.append(clock)
        return ends

    def end(self) -> float:
        ends = self.step_ends()
        return (ends[-1] if ends else self.start + self.startup_s) + self.tail_s


def write_run(
    run_dir: Path,
    attempts: Sequence[Attempt],
    *,
    checkpoints: Sequence[int] = (),
    done: bool,
    measured: Callable[[int], Mapping[str, object]] | None = None,
) -> None:
    """``run_dir`` as a run of ``attempts`` leaves it (see the module docstring); ``measured``
    gives a step's further keys (``runfiles.MEASURED``), appended to its line."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for attempt in attempts:
        ends = attempt.step_ends()
        for index, (step, ended) in enumerate(zip(attempt.steps, ends, strict=True)):
            record: dict[str, object] = {
                "step": step,
                "loss": 8.0 / (1 + 0.01 * step),
                "grad_norm": 1.0,
                "lr": 1e-3,
                "tokens_per_s": TOKENS_PER_STEP / attempt.step_time_s,
                "mfu": 0.4,
                "step_time_s": attempt.step_time_s,
                "data_time_s": attempt.data_time_s,
                "time": ended,
            }
            if index == 0:
                record["startup_s"] = attempt.startup_s
                if attempt.checkpoint_load_s:
                    record["checkpoint_load_s"] = attempt.checkpoint_load_s
                if attempt.resumed is not None:
                    record["resumed_from"], record["resumed_step"] = attempt.resumed
            if step in attempt.stalls:
                record["checkpoint_stall_s"] = attempt.stalls[step]
            if step in attempt.snapshot_stalls:
                record["snapshot_stall_s"] = attempt.snapshot_stalls[step]
            if step in attempt.evals:
                record["eval_time_s"] = attempt.evals[step]
            if measured is not None:
                record.update(measured(step))
            lines.append(json.dumps(record) + "\n")
        append_record(run_dir / rundir.ATTEMPTS, _record(attempt, ends))
    (run_dir / rundir.METRICS).write_text("".join(lines))
    for step in checkpoints:
        write_marker(rundir.step_dir(rundir.checkpoints_dir(run_dir), step))
    if done:
        write_marker(run_dir, rundir.DONE)


def _record(attempt: Attempt, ends: list[float]) -> AttemptRecord:
    steps = list(attempt.steps)
    first_step_at = ends[0] if ends else None
    return AttemptRecord(
        attempt=1,
        of=None,
        job=attempt.job,
        class_=attempt.class_,  # type: ignore[arg-type]
        exit_code=attempt.exit_code,
        timed_out=attempt.timed_out,
        first_failure_label=None if attempt.class_ == "success" else "rank0",
        started=_at(attempt.start),
        first_step_at=_at(first_step_at) if first_step_at is not None else None,
        ended=_at(attempt.end()),
        steps_seen=len(steps),
        first_step=steps[0] if steps else None,
        last_step=steps[-1] if steps else None,
        steps_gained=len(steps),
        hosts=attempt.hosts or (attempt.host, *attempt.replaced),
        evidence=attempt.evidence,
        replaced=dict(attempt.replaced),
        spares_left=(),
        decision="stop" if attempt.wait_s is None else "retry",
        reason="done" if attempt.wait_s is None else None,
        wait_s=attempt.wait_s,
        recovery=attempt.recovery,
    )


def _at(seconds: float) -> str:
    return timestamp(datetime.fromtimestamp(seconds, UTC))
