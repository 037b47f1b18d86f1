"""Where a run's wall time went: goodput, and badput by cause, from ``RunFiles`` alone.

Owns ``account`` (``RunFiles`` -> ``Accounting``), its parts' names (``CAUSES``), the records
it leaves out (``Ignored``) and the timeline it lays them on (``Span``, ``Accounting.timeline``):
the one definition of goodput. ``goodput chaos`` reports this account of its runs and builds its
per-fault figures on the timeline (``chaos.outcomes``); the benchmarks read it from there.

Every figure is a sum of **non-overlapping intervals of wall time**: the run is laid out on one
timeline and each second of it gets exactly one cause, so, whatever the files say, 0 <= goodput
<= 1, every cause is >= 0, every figure is finite and the causes with the productive time add
up to the wall time.

**Attempts** cover the timeline. A record of ``attempts.jsonl`` is ``[started, ended]``. The steps
no record holds were made by processes started by hand (``goodput train`` without the launcher,
before, between or after launched attempts): each runs from its first step's start less that
step's ``startup_s`` to its last step (to ``now`` for the run's last one while it goes on); a
step with ``startup_s`` begins a new one. **Wall time** runs from the first attempt's start to
the last one's end. Between two attempts: ``backoff`` (of one job) or ``queue`` (otherwise:
between jobs of a chain, or processes started by hand).

**Steps.** A step record's ``time`` is when the trainer wrote it: after the step (``step_time_s``:
data, compute, the stall of the checkpoint save before it) and after its eval (``eval_time_s``).
A step belongs to the attempt whose interval holds its ``time``. Its interval is its measured
duration, laid from its stamped start (``time`` less both) or from where the step before it
ended, whichever is later, and cut at its attempt's end: nothing is counted twice. Within an
attempt: its start to its first step is ``startup`` less the ``checkpoint_load`` (all of it
``in_process_recovery`` when the attempt began by recovering the one before in process,
``goodput launch --in-process``: ``recovery_parts`` splits it); the time
between steps is ``other`` (logging, the loop's own work); its last step to its end is ``hang``
when the idle watchdog ended it, else ``shutdown`` (the save and stop of a straggler's eviction,
class ``straggler``, too); an attempt without a step is ``failed_start``. Of a step's interval,
``data_time_s`` is ``data``, ``checkpoint_stall_s`` is ``checkpoint_save``, ``snapshot_stall_s`` (an
in-memory checkpoint's copy, and the wait for the one before it to settle) is ``snapshot``, the rest
compute: for every step number only its *last* run is **productive, preserved** time, every earlier
run was lost to a failure (``recomputed``, the whole run); while the run is not done, steps past its
newest complete checkpoint on disk are ``not_checkpointed`` (lost if it stopped here: a checkpoint
in memory does not outlive the job). An attempt says where its process loaded its state from
(``AttemptSummary.resumed_from``: its own in-memory checkpoint, its partner's copy, a checkpoint on
disk) when its first step record does.

**Goodput** = productive ÷ wall. In tokens: tokens kept ÷ what the median step throughput
would have trained over the whole wall time (never less than what was kept).

**Left out**, named by ``FILE:LINE`` (``Accounting.ignored``) and counted nowhere: a record that
cannot be placed on the timeline. A time past ``MAX_INSTANT``, a duration past ``MAX_SPAN_S``, a
throughput past ``MAX_TOKENS_PER_S``; a step that ends before the one before it did (the clock
went back), begins before it ended (they overlap) or begins before its attempt started; an
attempt that begins before the one before it ended. Overlaps up to ``CLOCK_SLACK_S`` are the
clocks' jitter (a step is timed by a monotonic clock and stamped by the wall clock, the launcher
may run on another host): the step is laid after the one before it, not named.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import asdict, dataclass, field
from datetime import datetime

from goodput import rundir
from goodput.launch.history import AttemptRecord, Evidence
from goodput.report.run_files import RunFiles, Step
from goodput.runfiles import StageMixture

CAUSES = (
    "startup",
    "checkpoint_load",
    "data",
    "checkpoint_save",
    "snapshot",
    "eval",
    "recomputed",
    "not_checkpointed",
    "hang",
    "shutdown",
    "failed_start",
    "in_process_recovery",
    "backoff",
    "queue",
    "other",
)
PRODUCTIVE = "productive"
SLOW_STEP = 1.5  # a step this many times the median is in the slow tail
CLOCK_SLACK_S = 1.0
RECORD_RESOLUTION_S = 0.001  # attempts.jsonl's times are to the millisecond
MAX_INSTANT = float(1 << 34)  # seconds since the epoch: the year 2514
MAX_SPAN_S = 366 * 86_400.0  # no step, start-up or attempt lasts a year
MAX_TOKENS_PER_S = 1e12  # a thousand times a 100,000-GPU machine's
MAX_IGNORED_LISTED = 1_000  # in --json; ``ignored_total`` counts them all
STEP_DURATIONS = ("step_time_s", "data_time_s", "checkpoint_stall_s", "snapshot_stall_s",
                  "checkpoint_load_s", "startup_s", "eval_time_s")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Ignored:
    """A record the account left out, and why."""

    file: str
    line: int
    why: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.why}"

    def as_json(self) -> dict[str, object]:
        return asdict(self)


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
    # The first line of the attempt's headline evidence (``headline``), or the failure's label.
    evidence: str | None
    hosts_evicted: list[str]
    recovery_s: float | None  # this attempt's end to the next one's first step (a failure's)
    # Where its process loaded its state from (snapshot, partner or checkpoint) and which step's,
    # as its first step record says; None: it did not say (a fresh start, an older trainer).
    resumed_from: str | None
    resumed_step: int | None
    # Began by recovering the attempt before in process: its parts (``recovery_parts``).
    in_process_recovery: dict[str, float] | None = None

    def loaded_from(self) -> str:
        """Its resume as a cell: ``partner @ 120``, the source alone, or ``-`` when unsaid."""
        if self.resumed_from is None:
            return "-" if self.resumed_step is None else f"? @ {self.resumed_step:,}"
        step = "" if self.resumed_step is None else f" @ {self.resumed_step:,}"
        return self.resumed_from + step

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
    timeline: tuple[Span, ...]  # the attempts with their steps, in time order (not in --json)
    ignored: list[Ignored] = field(default_factory=list)  # records left out, in file order
    stages: list[StageMixture] = field(default_factory=list)  # run.json's, for --json

    @property
    def goodput(self) -> float:
        # <= 1 but for the rounding of the sums: clamped where it crosses
        return min(self.productive_s / self.wall_s, 1.0) if self.wall_s > 0 else 0.0

    @property
    def token_goodput(self) -> float:
        return min(self.tokens_kept / self.tokens_ideal, 1.0) if self.tokens_ideal > 0 else 0.0

    def ignored_notes(self, limit: int = 5) -> list[str]:
        """The records left out, for a reader: a heading, the first ``limit``, how many more."""
        if not self.ignored:
            return []
        more = len(self.ignored) - limit
        return [
            f"note: {len(self.ignored):,} record(s) left out of the account (they do not fit "
            "the run's timeline):",
            *(f"  {record}" for record in self.ignored[:limit]),
            *([f"  ... and {more:,} more (--json lists them)"] if more > 0 else []),
        ]

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
            "ignored": [record.as_json() for record in self.ignored[:MAX_IGNORED_LISTED]],
            "ignored_total": len(self.ignored),
            "stages": [stage.as_json() for stage in self.stages],
        }


@dataclass(frozen=True, slots=True)
class Span:
    """One attempt on the timeline: ``[start, end]``, its record and line in attempts.jsonl
    (None: a process started by hand) and the steps placed in it, in time order."""

    start: float
    end: float
    record: AttemptRecord | None
    line: int | None
    steps: tuple[Step, ...]

    def lead_in(self) -> tuple[float, float]:
        """(start-up, checkpoint load): its start to its first step's start, as the account
        charges them; (0, 0) without a step (the account's ``failed_start``)."""
        if not self.steps:
            return 0.0, 0.0
        first = self.steps[0]
        load, rest = _split_gap(first, _clip(_begins(first), self.start, self.end) - self.start)
        return rest, load


@dataclass(slots=True)
class _Draft:
    """A ``Span`` while the timeline is laid: its end and steps still grow."""

    start: float
    end: float
    record: AttemptRecord | None
    line: int | None
    steps: list[Step] = field(default_factory=list)
    gap: int = -1  # by hand: the index of the recorded attempt before it (-1: none)


def account(run: RunFiles, now: float | None = None) -> Accounting:
    """The accounting of ``run`` (see the module docstring); ``now``: the end of a live
    attempt's wall time (default: its last step)."""
    ignored: list[Ignored] = []
    drafts, steps = _timeline(run, ignored)
    if drafts and drafts[-1].record is None and now is not None and now > drafts[-1].end:
        drafts[-1].end = min(now, MAX_INSTANT)
    spans = tuple(Span(d.start, d.end, d.record, d.line, tuple(d.steps)) for d in drafts)
    last_index = {step.step: index for index, step in enumerate(steps)}
    kept = [s for i, s in enumerate(steps) if last_index[s.step] == i]
    newest = max(run.checkpoint_steps, default=0)
    unsaved = {s.step for s in kept if not run.done and s.step > newest}
    fates = {
        id(step): "recomputed"
        if last_index[step.step] != index
        else "not_checkpointed"
        if step.step in unsaved
        else PRODUCTIVE
        for index, step in enumerate(steps)
    }
    seconds = _charge(spans, fates)
    productive = seconds.pop(PRODUCTIVE)
    start = spans[0].start if spans else 0.0
    end = spans[-1].end if spans else 0.0
    wall = end - start
    kept_productive = [s for s in kept if s.step not in unsaved]
    tokens_kept = sum(s.tokens for s in kept_productive)
    return Accounting(
        wall_s=wall,
        productive_s=productive,
        badput_s=seconds,
        start=start,
        end=end,
        tokens_kept=tokens_kept,
        tokens_ideal=max(wall * _median_rate(kept), float(tokens_kept)),
        steps_kept=len(kept_productive),
        steps_recomputed=len(steps) - len(kept),
        last_step=max(last_index, default=None),
        done=run.done,
        step_time=_step_time(kept),
        attempts=_attempt_summaries(spans, run.done),
        timeline=spans,
        ignored=ignored,
        stages=run.stages,
    )


def _timeline(run: RunFiles, ignored: list[Ignored]) -> tuple[list[_Draft], list[Step]]:
    """Every attempt, recorded or started by hand, with its steps: disjoint, in time order;
    and the steps placed, in file order. What cannot be placed goes to ``ignored``."""
    recorded = _recorded_spans(run, ignored)
    starts = [span.start for span in recorded]
    by_hand: list[_Draft] = []
    metrics = str(run.run_dir / rundir.METRICS)
    placed: list[Step] = []
    for step in run.steps:
        why = _implausible(step) or _out_of_order(step, placed[-1] if placed else None)
        if why is None:
            why = _place(step, recorded, starts, by_hand)
        if why is None:
            placed.append(step)
        else:
            ignored.append(Ignored(metrics, step.line, why))
    return sorted(recorded + by_hand, key=lambda span: (span.start, span.end)), placed


def _recorded_spans(run: RunFiles, ignored: list[Ignored]) -> list[_Draft]:
    """The attempt records that fit one after another, in file order."""
    attempts = str(run.run_dir / rundir.ATTEMPTS)
    spans: list[_Draft] = []
    for line, record in enumerate(run.attempts, 1):  # read_attempts: every line is one
        start, end = _instant(record.started), _instant(record.ended)
        before = spans[-1] if spans else None
        why = None
        if not 0 <= start <= end <= MAX_INSTANT:
            why = f"its times {record.started} to {record.ended} are not plausible instants"
        elif end - start > MAX_SPAN_S:
            why = f"it lasts {end - start:,.0f} s, more than a year"
        elif before is not None and start < before.end - CLOCK_SLACK_S:
            why = f"it starts {record.started}, before the attempt of line {before.line} ended"
        if why is not None:
            ignored.append(Ignored(attempts, line, why))
            continue
        start = max(start, before.end) if before is not None else start
        spans.append(_Draft(start, max(end, start), record, line))
    return spans


def _implausible(step: Step) -> str | None:
    if step.time > MAX_INSTANT:
        return f"step {step.step}: its time {step.time:g} is past the year 2514"
    for name in STEP_DURATIONS:
        value = getattr(step, name)
        if value is not None and value > MAX_SPAN_S:
            return f"step {step.step}: {name} {value:g} is more than a year"
    if step.step_time_s > 0 and step.tokens / step.step_time_s > MAX_TOKENS_PER_S:
        return f"step {step.step}: more than {MAX_TOKENS_PER_S:g} tokens/s"
    return None


def _out_of_order(step: Step, last: Step | None) -> str | None:
    """Why ``step`` cannot follow ``last`` (the step placed before it), if it cannot."""
    if last is None:
        return None
    if step.time < last.time - CLOCK_SLACK_S:
        return (
            f"step {step.step} ends at {step.time:.3f}, before step {last.step} (line "
            f"{last.line}) ended at {last.time:.3f}: the clock went back"
        )
    begins = _begins(step)
    if begins < last.time - CLOCK_SLACK_S:
        return (
            f"step {step.step} overlaps step {last.step} (line {last.line}) by "
            f"{last.time - begins:,.3f} s"
        )
    return None


def _place(
    step: Step, recorded: list[_Draft], starts: list[float], by_hand: list[_Draft]
) -> str | None:
    """Add ``step`` to the recorded attempt that holds its time, or else to the process started
    by hand it belongs to (a new one at a start, or past a recorded attempt); why it fits
    neither, if it does not."""
    begins = _begins(step)
    # The last attempt that started before it ended (the records' times are rounded).
    held = bisect.bisect_right(starts, step.time - RECORD_RESOLUTION_S) - 1
    before = recorded[held] if held >= 0 else None
    if before is not None and step.time <= before.end + RECORD_RESOLUTION_S:
        if begins < before.start - CLOCK_SLACK_S:
            return (
                f"step {step.step} begins {before.start - begins:,.3f} s before its attempt "
                f"(attempts.jsonl line {before.line}) started"
            )
        before.steps.append(step)
        return None
    floor = before.end if before is not None else -math.inf
    if before is not None and begins < floor - CLOCK_SLACK_S:
        return (
            f"step {step.step} begins {floor - begins:,.3f} s before the attempt of "
            f"attempts.jsonl line {before.line} ended"
        )
    # Before the next recorded attempt, which may have started within the rounding.
    ceiling = recorded[held + 1].start if held + 1 < len(recorded) else math.inf
    current = by_hand[-1] if by_hand and by_hand[-1].gap == held else None
    if current is None or step.startup_s is not None:
        start = max(begins - (step.startup_s or 0.0), floor)
        start = min(max(start, by_hand[-1].end) if by_hand else start, ceiling)
        end = _clip(step.time, start, ceiling)
        by_hand.append(_Draft(start, end, None, None, [step], gap=held))
    else:
        current.end = _clip(step.time, current.end, ceiling)
        current.steps.append(step)
    return None


def _begins(step: Step) -> float:
    return step.time - step.eval_time_s - step.step_time_s


def _charge(spans: tuple[Span, ...], fates: dict[int, str]) -> dict[str, float]:
    """Seconds by cause (and ``PRODUCTIVE``): every second of the wall time given one;
    ``fates``: each placed step's (by ``id``): recomputed, not_checkpointed or productive."""
    seconds = dict.fromkeys(CAUSES, 0.0) | {PRODUCTIVE: 0.0}
    for index, span in enumerate(spans):
        if index:
            before = spans[index - 1].record
            same_job = span.record is not None and before is not None
            same_job = same_job and span.record.job == before.job  # type: ignore[union-attr]
            seconds["backoff" if same_job else "queue"] += span.start - spans[index - 1].end
        _charge_span(span, fates, seconds)
    return seconds


def _charge_span(span: Span, fates: dict[int, str], seconds: dict[str, float]) -> None:
    """Tile ``span``: start-up, each step with the gap before it, and the tail. A step's interval
    is its measured duration (``step_time_s``, then ``eval_time_s``: a monotonic clock's),
    laid from its stamped start or from where the step before it ended, whichever is later (the
    stamps jitter by milliseconds), and cut at the span's end."""
    if not span.steps:
        seconds["failed_start"] += span.end - span.start
        return
    cursor = span.start
    for index, step in enumerate(span.steps):
        begin = _clip(_begins(step), cursor, span.end)
        length = min(step.step_time_s, span.end - begin)
        evaluating = min(step.eval_time_s, span.end - begin - length)
        load, rest = _split_gap(step, begin - cursor)
        if index == 0 and in_process(span.record):
            seconds["in_process_recovery"] += load + rest
        else:
            seconds["checkpoint_load"] += load
            seconds["startup" if index == 0 or step.startup_s is not None else "other"] += rest
        _charge_step(step, length, fates[id(step)], seconds)
        seconds["eval"] += evaluating
        cursor = min(begin + length + evaluating, span.end)
    timed_out = span.record is not None and span.record.timed_out
    seconds["hang" if timed_out else "shutdown"] += span.end - cursor


def in_process(record: AttemptRecord | None) -> bool:
    """Whether the attempt began by recovering the one before in process (``--in-process``)."""
    return record is not None and record.recovery is not None and record.recovery.fallback is None


def recovery_parts(span: Span, before: Span | None) -> dict[str, float] | None:
    """An in-process attempt's recovery, part by part: ``detection`` (the attempt before's last
    step to the death the launcher saw), ``abort`` and ``rendezvous`` (the launcher's),
    ``restore`` (the first step's checkpoint load), ``rebuild`` (the rest before the first step:
    the model, optimizer and loader built again) and ``first_step``. None for another attempt."""
    record = span.record
    if not in_process(record) or not span.steps:
        return None
    assert record is not None and record.recovery is not None
    first = span.steps[0]
    rest, load = span.lead_in()
    abort = record.recovery.abort_s or 0.0
    rendezvous = record.recovery.rendezvous_s or 0.0
    detection = 0.0
    if before is not None and before.steps:
        last = before.steps[-1]
        detection = max(before.end - (_begins(last) + last.step_time_s), 0.0)
    return {
        "detection_s": round(detection, 3),
        "abort_s": abort,
        "rendezvous_s": rendezvous,
        "restore_s": round(load, 3),
        "rebuild_s": round(max(rest - abort - rendezvous, 0.0), 3),
        "first_step_s": round(first.step_time_s, 3),
    }


def _split_gap(step: Step, gap: float) -> tuple[float, float]:
    """The ``gap`` seconds before ``step``: its checkpoint load (as far as it fits), the rest."""
    load = min(step.checkpoint_load_s, gap)
    return load, gap - load


def _charge_step(step: Step, length: float, fate: str, seconds: dict[str, float]) -> None:
    """A step's ``length`` seconds on the timeline: all lost when it was run again, else its
    data wait, checkpoint stall and snapshot stall (as far as they fit), then its compute."""
    if fate == "recomputed":
        seconds["recomputed"] += length
        return
    data = min(step.data_time_s, length)
    stall = min(step.checkpoint_stall_s, length - data)
    snapshot = min(step.snapshot_stall_s, length - data - stall)
    seconds["data"] += data
    seconds["checkpoint_save"] += stall
    seconds["snapshot"] += snapshot
    seconds[fate] += length - data - stall - snapshot


def _clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _attempt_summaries(spans: tuple[Span, ...], done: bool) -> list[AttemptSummary]:
    """One per span; a span without a record is ``running`` when it is the run's last and the
    run is not done, else ``unrecorded`` (a process started by hand, which no launcher saw)."""
    summaries: list[AttemptSummary] = []
    for index, span in enumerate(spans):
        record, mine = span.record, span.steps
        recovery = None
        if record is not None and record.class_ != "success":
            later = next((s.steps[0] for s in spans[index + 1 :] if s.steps), None)
            recovery = None if later is None else max(_begins(later) - span.end, 0.0)
        evidence = (
            headline(record).said.splitlines()[0][:200]
            if record is not None and record.evidence
            else (record.first_failure_label if record is not None else None)
        )
        resumed = next(
            (s for s in mine if s.resumed_from is not None or s.resumed_step is not None), None
        )
        summaries.append(
            AttemptSummary(
                attempt=(
                    record.attempt
                    if record is not None
                    else summaries[-1].attempt + 1
                    if summaries
                    else 1
                ),
                job=record.job if record is not None else None,
                class_=(
                    record.class_
                    if record is not None
                    else "running"
                    if index == len(spans) - 1 and not done
                    else "unrecorded"
                ),
                exit_code=record.exit_code if record is not None else None,
                started=span.start,
                ended=span.end,
                steps_gained=record.steps_gained if record is not None else len(mine),
                first_step=mine[0].step if mine else None,
                last_step=mine[-1].step if mine else None,
                evidence=evidence,
                hosts_evicted=sorted(record.replaced) if record is not None else [],
                recovery_s=recovery,
                resumed_from=resumed.resumed_from if resumed is not None else None,
                resumed_step=resumed.resumed_step if resumed is not None else None,
                in_process_recovery=recovery_parts(span, spans[index - 1] if index else None),
            )
        )
    return summaries


def headline(record: AttemptRecord) -> Evidence:
    """The one item of a record's (non-empty) evidence its attempt row shows: the hang's first
    suspect (its line names the rank and the host); else the first that is not a straggler
    warning (what blamed a host, or named one a probe cleared); else the first warning."""
    return min(
        record.evidence,
        key=lambda item: (item.source != "hang-suspect", item.source == "straggler"),
    )


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
