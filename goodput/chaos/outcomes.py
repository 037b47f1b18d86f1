"""What each planned fault cost: its outcome, built on the report's timeline of the faulted run.

Goodput and badput by cause are not defined here: a campaign reports ``report.accounting``'s
account of each run (the one definition), and this module adds, per fault, what that account
does not say, from the same ``Span``s (attempts with the steps placed in them) and the fault's
fired record (``records``):

  - the **attempt** it fired in: the span whose ``[start, end]`` holds its time (the launcher's
    times are to the millisecond); none when no span does, or the span was started by hand;
  - for a fault that ends an attempt (``ENDS_ATTEMPT``), in an attempt that failed after a step:
    **detection**, from the fault to the attempt's end plus the launcher's time to the next
    attempt beyond the wait (classifying, probing hosts); **backoff**, the wait; the
    **start-up** and **load** of the next attempt that made a step (``Span.lead_in``: as the
    account charges them) and its **first step**; the **steps lost** (the last step its attempt
    reached, less the step the next one resumed from) and the **recovery** time, from the fault
    to the end of that first step back; where that attempt **loaded from** (``snapshot``: every
    rank's own in-memory checkpoint, ``partner``: some rank's partner copy, ``checkpoint``: the
    disk) and the step it loaded, as its first step record says (``Step.resumed_from``,
    ``resumed_step``; None where the record does not say, as a fresh start's does not);
  - for a ``slow`` or ``stall`` fault (``NAMED``), the **host** it was injected on (its rank's
    host in the attempt it fired in, as the ranks name it: ``ranks.launcher_host``) and the
    rank and host the launcher **named** for it, from the attempts' evidence
    (``attempts.jsonl``): a stall takes the ``hang-suspect`` evidence of the attempt it fired
    in (the first: suspects come first); a slow fault the first ``straggler`` evidence, in
    attempt order, whose ``step`` falls in its window. None where no evidence says.

Every figure is None where it does not apply, else finite and >= 0, whatever the files say: a
fault is placed only inside an attempt, and the timeline's spans are disjoint and in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from goodput.chaos.records import FiredRecord
from goodput.faults import Fault
from goodput.launch.history import Evidence
from goodput.ranks import launcher_host
from goodput.report.accounting import RECORD_RESOLUTION_S, Span, recovery_parts

# The kinds that end the attempt they fire in; the others let it go on.
ENDS_ATTEMPT = frozenset(
    {"kill", "ckpt-kill", "hang", "bad-node", "stall", "snapshot-kill", "host-loss"}
)
NAMED = frozenset({"slow", "stall"})  # the kinds the launcher must name the rank and host of


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
    loaded_from: str | None  # where the attempt that came back loaded: runfiles.RESUMED_FROM
    resumed_step: int | None  # the step it loaded
    host: str | None  # the host of the fault's rank in the attempt it fired in
    named_rank: int | None  # slow and stall: the rank the launcher named for it
    named_host: str | None
    # The attempt that came back recovered in process (``goodput launch --in-process``): its
    # recovery's parts (``accounting.recovery_parts``), detection measured from the fault.
    in_process_recovery: dict[str, float] | None = None

    @property
    def named_right(self) -> bool:
        """Whether the launcher named the fault's own rank and host (a kind it must name)."""
        return (self.named_rank, self.named_host) == (self.fault.rank, self.host) and (
            self.host is not None
        )


def fault_outcomes(
    faults: Sequence[Fault],
    fired: Sequence[FiredRecord],
    timeline: Sequence[Span],
    *,
    ranks_per_host: int,
) -> list[FaultOutcome]:
    """What became of each planned fault, in plan order; ``timeline``: the faulted run's
    (``Accounting.timeline``), whose ranks ran ``ranks_per_host`` to a host."""
    by_id = {record.id: record for record in fired}
    return [
        _named(_outcome(fault, by_id.get(fault.id), timeline), timeline, ranks_per_host)
        for fault in faults
    ]


def _named(outcome: FaultOutcome, timeline: Sequence[Span], ranks_per_host: int) -> FaultOutcome:
    """``outcome`` with the injected host and, for a kind in ``NAMED``, whom the evidence named."""
    fault, fired = outcome.fault, outcome.fired
    index = None if fired is None else _holding(timeline, fired.time)
    fired_in = None if index is None else timeline[index].record
    if fired_in is None:
        return outcome
    records = [span.record for span in timeline if span.record is not None]
    host = launcher_host(fault.rank, fired_in.hosts, ranks_per_host)
    named: Evidence | None = None
    if fault.kind == "stall":
        named = next((e for e in fired_in.evidence if e.source == "hang-suspect"), None)
    elif fault.kind == "slow":
        found = (e for r in records for e in r.evidence if e.source == "straggler")
        named = next((e for e in found if e.step is not None and fault.in_window(e.step)), None)
    if named is None:
        return replace(outcome, host=host)
    return replace(outcome, host=host, named_rank=named.rank, named_host=named.host)


def _outcome(fault: Fault, fired: FiredRecord | None, timeline: Sequence[Span]) -> FaultOutcome:
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
        loaded_from=None,
        resumed_step=None,
        host=None,
        named_rank=None,
        named_host=None,
    )
    if fired is None or not timeline:
        return empty
    index = _holding(timeline, fired.time)
    span = timeline[index] if index is not None else None
    record = span.record if span is not None else None
    at_s = max(0.0, fired.time - timeline[0].start)
    placed = replace(empty, at_s=at_s, attempt=None if record is None else record.attempt)
    if span is None or record is None or index is None:  # outside every launched attempt
        return placed
    if fault.kind not in ENDS_ATTEMPT or record.class_ == "success" or not span.steps:
        return placed
    beyond_wait = _beyond_wait_s(timeline, index, record.wait_s or 0.0)
    detection_s = max(0.0, span.end - fired.time) + beyond_wait
    after_index = next((i for i in range(index + 1, len(timeline)) if timeline[i].steps), None)
    if after_index is None:  # the run never came back
        return replace(placed, detection_s=detection_s, backoff_s=record.wait_s)
    after = timeline[after_index]
    first = after.steps[0]
    startup_s, load_s = after.lead_in()
    parts = recovery_parts(after, timeline[after_index - 1])
    if parts is not None:
        parts["detection_s"] = round(detection_s, 3)
    return replace(
        placed,
        detection_s=detection_s,
        backoff_s=record.wait_s,
        startup_s=startup_s,
        load_s=load_s,
        first_step_s=first.step_time_s,
        steps_lost=max(0, max(step.step for step in span.steps) - (first.step - 1)),
        recovery_s=max(0.0, first.time - fired.time),
        loaded_from=first.resumed_from,
        resumed_step=first.resumed_step,
        in_process_recovery=parts,
    )


def _holding(timeline: Sequence[Span], when: float) -> int | None:
    """The index of the span whose interval holds ``when`` (to the records' resolution)."""
    for index, span in enumerate(timeline):
        if span.start - RECORD_RESOLUTION_S <= when <= span.end + RECORD_RESOLUTION_S:
            return index
    return None


def _beyond_wait_s(timeline: Sequence[Span], index: int, wait_s: float) -> float:
    """The launcher's time from the span to the next one beyond the wait: classifying, probing."""
    if index + 1 == len(timeline):
        return 0.0
    return max(0.0, timeline[index + 1].start - timeline[index].end - wait_s)
