"""Where a run's wall time went, and what each fault cost: computed from what the run recorded.

Inputs: the attempts of ``attempts.jsonl``, the step records of ``metrics.jsonl``, the faults'
fired records and the trainer's ``resume: ... loaded in X s`` lines (``records``). Every time is
wall-clock (the trainer's ``time.time()`` and the launcher's UTC instants read the same clock).
A step record belongs to the last attempt that started before it; a resume line to the first
attempt after the previous match whose first step follows the checkpoint it names (an attempt
that dies before its first step is not told apart from the next one by its resume line).

**Goodput** is productive time over wall time:
  - wall: from the first attempt's start to the last one's end;
  - productive: the step time of each step's last run, the run the final state comes from
    (step time is the whole iteration: data, compute, logging, checkpoint stall).
The rest, each defined per attempt and summed:
  - recomputed: the step time of every earlier run of a step, lost to a fault and run again;
  - detection: for an attempt that failed, from its fault (its first fault that ends attempts;
    without one, or if a step was recorded after it, its last step) to its end, plus the
    launcher's time between attempts other than the wait (classifying, probing hosts);
  - backoff: the ``wait_s`` before each retry;
  - load: the checkpoint load of each resumed attempt;
  - start-up: from an attempt's start to the start of its first step, less its load; the whole
    life of an attempt without a step;
  - other: what is left: the final save and exit, and an attempt's time between its last step
    and its fault (a kill during a checkpoint flush).

Per fault that ends an attempt: its detection (as above, for its attempt), the backoff after
it, the start-up, load and first step of the next attempt that made a step, the steps lost (the
last step its attempt recorded, less the step that attempt resumed from) and the **recovery
time**: from the fault to that first step back.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from goodput.chaos.records import FiredRecord, ResumeLoad, StepRecord
from goodput.faults import Fault
from goodput.launch.history import AttemptRecord

ENDS_ATTEMPT = frozenset({"kill", "ckpt-kill", "hang", "bad-node"})  # the others: the run goes on


@dataclass(frozen=True, slots=True)
class Span:
    """One attempt as the accounting sees it: its record, its times, its steps and its load."""

    record: AttemptRecord
    started: float
    ended: float
    steps: tuple[StepRecord, ...]
    load_s: float

    @property
    def startup_s(self) -> float:
        if not self.steps:
            return self.ended - self.started
        first = self.steps[0]
        return max(0.0, first.time - first.step_time_s - self.started - self.load_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Goodput:
    wall_s: float
    productive_s: float
    recomputed_s: float
    detection_s: float
    backoff_s: float
    load_s: float
    startup_s: float
    other_s: float
    num_steps: int  # distinct steps recorded
    num_step_runs: int  # step records in all: a step run again counts again

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultOutcome:
    """A planned fault and what became of it; None where it does not apply (not fired, or a kind
    that does not end an attempt, or a run that never came back)."""

    fault: Fault
    fired: FiredRecord | None
    at_s: float | None  # when it fired, from the run's start
    attempt: int | None  # the attempt it fired in
    detection_s: float | None
    backoff_s: float | None
    startup_s: float | None  # of the attempt that came back
    load_s: float | None
    first_step_s: float | None
    steps_lost: int | None
    recovery_s: float | None  # fault -> first step back


def instant(text: str) -> float:
    """An ``attempts.jsonl`` time as seconds since the epoch."""
    return datetime.fromisoformat(text).timestamp()


def spans(
    attempts: Sequence[AttemptRecord], steps: Sequence[StepRecord], loads: Sequence[ResumeLoad]
) -> list[Span]:
    """The attempts in order, each with its step records and its checkpoint load."""
    starts = [instant(record.started) for record in attempts]
    steps_of: list[list[StepRecord]] = [[] for _ in attempts]
    for step in steps:
        steps_of[max(0, bisect.bisect_right(starts, step.time) - 1)].append(step)
    found, next_load = [], 0
    for record, started, its_steps in zip(attempts, starts, steps_of, strict=True):
        load_s = 0.0
        if its_steps and its_steps[0].step > 1:
            resumed_from = its_steps[0].step - 1
            for index in range(next_load, len(loads)):
                if loads[index].step == resumed_from:
                    load_s, next_load = loads[index].seconds, index + 1
                    break
        span = Span(record, started, instant(record.ended), tuple(its_steps), load_s)
        found.append(span)
    return found


def account(runs: Sequence[Span], fired: Sequence[FiredRecord]) -> Goodput:
    """The goodput of a run and the breakdown of the rest (module docstring)."""
    assert runs, "a run has at least one attempt"
    steps = [step for span in runs for step in span.steps]
    last_run = {step.step: index for index, step in enumerate(steps)}
    productive_s = sum(steps[index].step_time_s for index in last_run.values())
    wall_s = runs[-1].ended - runs[0].started
    parts = {
        "productive_s": productive_s,
        "recomputed_s": sum(step.step_time_s for step in steps) - productive_s,
        "detection_s": sum(_detection_s(runs, index, fired) or 0.0 for index in range(len(runs))),
        "backoff_s": sum(span.record.wait_s or 0.0 for span in runs),
        "load_s": sum(span.load_s for span in runs),
        "startup_s": sum(span.startup_s for span in runs),
    }
    return Goodput(
        wall_s=wall_s,
        other_s=wall_s - sum(parts.values()),
        num_steps=len(last_run),
        num_step_runs=len(steps),
        **parts,
    )


def _detection_s(runs: Sequence[Span], index: int, fired: Sequence[FiredRecord]) -> float | None:
    """The attempt's end less its fault (or its last step), plus the launcher's time to the
    next attempt beyond the wait; None for an attempt that succeeded or made no step."""
    span = runs[index]
    if span.record.class_ == "success" or not span.steps:
        return None
    faults = [f.time for f in _fired_in(span, fired) if f.kind in ENDS_ATTEMPT]
    last_step = span.steps[-1].time
    noticed_from = max(min(faults), last_step) if faults else last_step
    return span.ended - noticed_from + _decision_s(runs, index)


def _decision_s(runs: Sequence[Span], index: int) -> float:
    if index + 1 == len(runs):
        return 0.0
    gap = runs[index + 1].started - runs[index].ended
    return max(0.0, gap - (runs[index].record.wait_s or 0.0))


def _fired_in(span: Span, fired: Sequence[FiredRecord]) -> list[FiredRecord]:
    return [record for record in fired if span.started <= record.time <= span.ended]


def fault_outcomes(
    faults: Sequence[Fault], fired: Sequence[FiredRecord], runs: Sequence[Span]
) -> list[FaultOutcome]:
    """What became of each planned fault, in plan order."""
    by_id = {record.id: record for record in fired}
    return [_outcome(fault, by_id.get(fault.id), runs) for fault in faults]


def _outcome(fault: Fault, fired: FiredRecord | None, runs: Sequence[Span]) -> FaultOutcome:
    empty = FaultOutcome(
        fault=fault,
        fired=fired,
        at_s=None,
        attempt=None,
        detection_s=None,
        backoff_s=None,
        startup_s=None,
        load_s=None,
        first_step_s=None,
        steps_lost=None,
        recovery_s=None,
    )
    if fired is None or not runs:
        return empty
    starts = [span.started for span in runs]
    index = max(0, bisect.bisect_right(starts, fired.time) - 1)
    span = runs[index]
    placed = replace(empty, at_s=fired.time - runs[0].started, attempt=span.record.attempt)
    if fault.kind not in ENDS_ATTEMPT or span.record.class_ == "success" or not span.steps:
        return placed
    after = next((later for later in runs[index + 1 :] if later.steps), None)
    detection_s = span.ended - fired.time + _decision_s(runs, index)
    if after is None:  # the run never came back
        return replace(placed, detection_s=detection_s, backoff_s=span.record.wait_s)
    first = after.steps[0]
    return replace(
        placed,
        detection_s=detection_s,
        backoff_s=span.record.wait_s,
        startup_s=after.startup_s,
        load_s=after.load_s,
        first_step_s=first.step_time_s,
        steps_lost=max(0, max(step.step for step in span.steps) - (first.step - 1)),
        recovery_s=first.time - fired.time,
    )
