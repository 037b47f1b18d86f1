"""Where a run's wall time went: goodput, and badput by cause, from ``RunFiles`` alone.

Owns ``account`` (``RunFiles`` -> ``Accounting``) and its parts' names, ``CAUSES``.

**Wall time** runs from the first attempt's start to the last thing the run did (the last
attempt's end, or its last step when the attempt is still going), across every job of a chain.
Without ``attempts.jsonl`` (``goodput train`` run by hand), each process's start is its first
step's start less that step's ``startup_s``.

**Productive, preserved** time is the compute of the steps that count: for every step number,
its *last* run (an earlier run of the same step was lost to a failure and recomputed), less
what the trainer measured inside the step that is not training (``data_time_s``, the
``checkpoint_stall_s`` of the save before it). When the run is not done, the steps past its
newest complete checkpoint are not preserved yet (``not_checkpointed``: lost if it stopped
here). **Goodput** = productive ÷ wall; the same in tokens is tokens kept ÷ wall × the median
throughput of a step (what the run would have trained with no failure and no stall).

**Badput**, by cause, in seconds (``CAUSES``): ``startup`` (an attempt's start to its first
step, less the checkpoint load), ``checkpoint_load``, ``data`` (waiting for batches),
``checkpoint_save`` (training held by saves), ``eval`` (in-loop evals), ``recomputed`` (steps run
again after a failure), ``not_checkpointed``, ``hang`` (an attempt's last step to the watchdog's
kill, when it fired), ``shutdown`` (the last step to the attempt's end otherwise: the final
flush, exit, a crash's detection), ``failed_start`` (attempts that never reached a step),
``backoff`` (between attempts of one job), ``queue`` (between jobs of a chain, or between
processes of a run launched by hand) and ``other`` (what is left: logging, the loop's own
work). They and the productive time add up to the wall time.

Steps belong to the attempt whose ``[started, ended]`` holds their end time; steps after the last
recorded attempt belong to one still running (its record is written when it ends).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from datetime import datetime

from goodput.launch.history import AttemptRecord
from goodput.report.run_files import RunFiles, Step

CAUSES = (
    "startup",
    "checkpoint_load",
    "data",
    "checkpoint_save",
    "eval",
    "recomputed",
    "not_checkpointed",
    "hang",
    "shutdown",
    "failed_start",
    "backoff",
    "queue",
    "other",
)
SLOW_STEP = 1.5  # a step this many times the median is in the slow tail


@dataclass(frozen=True, slots=True)
class AttemptSummary:
    attempt: int
    job: str | None
    class_: str  # the launcher's class; running, or unrecorded (no record: started by hand)
    exit_code: int | None  # None: no record
    started: float  # seconds since the epoch
    ended: float
    steps_gained: int
    first_step: int | None
    last_step: int | None
    evidence: str | None  # the first line of evidence against a host, or the failure's label
    hosts_evicted: list[str]
    recovery_s: float | None  # this attempt's end to the next one's first step (a failure's)

    def as_json(self) -> dict[str, object]:
        row = asdict(self)
        row["class"] = row.pop("class_")
        return row


@dataclass(frozen=True, slots=True)
class Accounting:
    wall_s: float
    productive_s: float
    badput_s: dict[str, float]  # CAUSES -> seconds
    start: float  # seconds since the epoch
    end: float
    tokens_kept: int
    tokens_ideal: float
    steps_kept: int
    steps_recomputed: int
    last_step: int | None
    done: bool
    step_time: dict[str, float | int]  # median, p90, p99, max, slow_steps (kept steps)
    attempts: list[AttemptSummary]

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def token_goodput(self) -> float:
        return self.tokens_kept / self.tokens_ideal if self.tokens_ideal > 0 else 0.0

    def as_json(self) -> dict[str, object]:
        wall = self.wall_s or math.inf
        return {
            "goodput": self.goodput,
            "wall_s": self.wall_s,
            "productive_s": self.productive_s,
            "badput_s": dict(self.badput_s),
            "badput_pct": {cause: 100 * s / wall for cause, s in self.badput_s.items()},
            "tokens": {
                "kept": self.tokens_kept,
                "ideal": self.tokens_ideal,
                "goodput": self.token_goodput,
            },
            "steps": {
                "kept": self.steps_kept,
                "recomputed": self.steps_recomputed,
                "last": self.last_step,
                "done": self.done,
            },
            "step_time_s": dict(self.step_time),
            "start": self.start,
            "end": self.end,
            "attempts": [attempt.as_json() for attempt in self.attempts],
        }


def account(run: RunFiles, now: float | None = None) -> Accounting:
    """The accounting of ``run`` (see the module docstring); ``now``: the end of a live
    attempt's wall time (default: its last step)."""
    badput = dict.fromkeys(CAUSES, 0.0)
    steps = run.steps
    last_index = {step.step: index for index, step in enumerate(steps)}
    kept = [s for i, s in enumerate(steps) if last_index[s.step] == i]
    newest = max(run.checkpoint_steps, default=0)
    unsaved = {s.step for s in kept if not run.done and s.step > newest}
    productive = 0.0
    for index, step in enumerate(steps):
        badput["eval"] += step.eval_time_s
        badput["checkpoint_load"] += step.checkpoint_load_s
        if last_index[step.step] != index:
            badput["recomputed"] += step.step_time_s
            continue
        inside = step.data_time_s + step.checkpoint_stall_s
        compute = max(step.step_time_s - inside, 0.0)
        badput["data"] += step.data_time_s
        badput["checkpoint_save"] += step.checkpoint_stall_s
        if step.step in unsaved:
            badput["not_checkpointed"] += compute
        else:
            productive += compute
    spans = _spans(run, steps, now)
    members = [[s for s in steps if started <= s.time <= ended] for started, ended, _ in spans]
    _charge_spans(spans, members, badput)
    start = min((s[0] for s in spans), default=0.0)
    end = max((s[1] for s in spans), default=0.0)
    wall = max(end - start, 0.0)
    accounted = productive + sum(badput.values())
    badput["other"] = max(wall - accounted, 0.0)
    kept_productive = [s for s in kept if s.step not in unsaved]
    return Accounting(
        wall_s=wall,
        productive_s=productive,
        badput_s=badput,
        start=start,
        end=end,
        tokens_kept=sum(s.tokens for s in kept_productive),
        tokens_ideal=wall * _median_rate(kept),
        steps_kept=len(kept_productive),
        steps_recomputed=len(steps) - len(kept),
        last_step=max(last_index, default=None),
        done=run.done,
        step_time=_step_time(kept),
        attempts=_attempt_summaries(spans, members, steps, run.done),
    )


Span = tuple[float, float, AttemptRecord | None]  # (start, end, its record if any)


def _spans(run: RunFiles, steps: list[Step], now: float | None) -> list[Span]:
    """Every attempt: the recorded ones, then the processes after them no record covers."""
    spans: list[Span] = [(_instant(r.started), _instant(r.ended), r) for r in run.attempts]
    recorded_end = spans[-1][1] if spans else -math.inf
    return spans + _processes([s for s in steps if s.time > recorded_end], now)


def _charge_spans(spans: list[Span], members: list[list[Step]], badput: dict[str, float]) -> None:
    """Charge each attempt's start and tail, and the gaps between attempts, to their causes;
    ``members``: each span's steps."""
    previous: tuple[float, AttemptRecord | None] | None = None
    for (started, ended, record), mine in zip(spans, members, strict=True):
        if previous is not None:
            gap = max(started - previous[0], 0.0)
            same_job = record is not None and previous[1] is not None
            same_job = same_job and record.job == previous[1].job  # type: ignore[union-attr]
            badput["backoff" if same_job else "queue"] += gap
        if not mine:
            badput["failed_start"] += ended - started
        else:
            first = mine[0]
            first_start = first.time - first.step_time_s
            badput["startup"] += max(first_start - started - first.checkpoint_load_s, 0.0)
            tail = max(ended - mine[-1].time - mine[-1].eval_time_s, 0.0)
            timed_out = record is not None and record.timed_out
            badput["hang" if timed_out else "shutdown"] += tail
        previous = (ended, record)


def _processes(steps: list[Step], now: float | None) -> list[Span]:
    """Spans of processes no attempt record covers, cut where a step says it began one
    (``startup_s``); the last one runs to ``now`` when given."""
    spans: list[Span] = []
    for step in steps:
        done = step.time + step.eval_time_s
        if step.startup_s is not None or not spans:
            begin = step.time - step.step_time_s - (step.startup_s or 0.0)
            spans.append((begin, done, None))
        else:
            begin, _, record = spans[-1]
            spans[-1] = (begin, done, record)
    if spans and now is not None and now > spans[-1][1]:
        spans[-1] = (spans[-1][0], now, None)
    return spans


def _attempt_summaries(
    spans: list[Span], members: list[list[Step]], steps: list[Step], done: bool
) -> list[AttemptSummary]:
    """One per span; a span without a record is ``running`` when it is the run's last and the
    run is not done, else ``unrecorded`` (a process started by hand, which no launcher saw)."""
    summaries = []
    recorded = sum(record is not None for _, _, record in spans)
    for index, ((started, ended, record), mine) in enumerate(zip(spans, members, strict=True)):
        following = spans[index + 1 :]
        recovery = None
        if record is not None and record.class_ != "success" and following:
            later = [s for s in steps if s.time > ended]
            if later:
                recovery = later[0].time - later[0].step_time_s - ended
        evidence = (
            record.evidence[0].said.splitlines()[0][:200]
            if record is not None and record.evidence
            else (record.first_failure_label if record is not None else None)
        )
        summaries.append(
            AttemptSummary(
                attempt=record.attempt if record is not None else recorded + 1,
                job=record.job if record is not None else None,
                class_=(
                    record.class_
                    if record is not None
                    else "running"
                    if index == len(spans) - 1 and not done
                    else "unrecorded"
                ),
                exit_code=record.exit_code if record is not None else None,
                started=started,
                ended=ended,
                steps_gained=record.steps_gained if record is not None else len(mine),
                first_step=mine[0].step if mine else None,
                last_step=mine[-1].step if mine else None,
                evidence=evidence,
                hosts_evicted=sorted(record.replaced) if record is not None else [],
                recovery_s=recovery,
            )
        )
    return summaries


def _step_time(kept: list[Step]) -> dict[str, float | int]:
    times = sorted(s.step_time_s for s in kept)
    if not times:
        return {"median": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "slow_steps": 0}
    median = statistics.median(times)
    return {
        "median": median,
        "p90": _quantile(times, 0.90),
        "p99": _quantile(times, 0.99),
        "max": times[-1],
        "slow_steps": sum(t > SLOW_STEP * median for t in times),
    }


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def _median_rate(kept: list[Step]) -> float:
    rates = [s.tokens / s.step_time_s for s in kept if s.step_time_s > 0]
    return statistics.median(rates) if rates else 0.0


def _instant(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()
