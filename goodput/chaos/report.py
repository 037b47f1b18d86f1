"""A campaign's report: one value, printed as tables for a person and written as JSON for tools.

It holds what was asked and changed (config, seed, ranks, the interval chaos had to set, the
idle timeout), each fault and what became of it (``outcomes.FaultOutcome``), the attempts and
their classes, the goodput of the faulted and the straight run with the badput by cause (each
run's ``report.accounting.Accounting``, in JSON as ``goodput report --json`` writes it), and the
verdict: whether the final state is bitwise equal to the straight run's, every planned
fault fired, the faulted run finished, and for every ``slow`` and ``stall`` fault the launcher
named the rank and host it was injected on (``outcomes.NAMED``; each fault's ``host``,
``named_rank`` and ``named_host`` are in the JSON), and, with in-memory checkpoints on
(``memory_interval_steps`` k > 0), every fault that ended an attempt lost at most k steps and
every ``host-loss`` restart loaded the lost host's state from its partner's copy (each fault's
``loaded_from`` and ``resumed_step`` are in the JSON, and in the table's "from" column).
``passed`` is that verdict; ``goodput chaos`` exits 0 only when it holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput.chaos.compare import PARTS, Comparison
from goodput.chaos.outcomes import ENDS_ATTEMPT, NAMED, FaultOutcome
from goodput.io import write_json
from goodput.launch.history import AttemptRecord
from goodput.report.accounting import Accounting


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    config: str
    output: str
    seed: int
    num_ranks: int
    kinds: tuple[str, ...]
    notes: tuple[str, ...]  # what chaos changed or left out, and why
    idle_timeout_s: float | None
    memory_interval_steps: int  # checkpoint.memory_interval_steps of both runs; 0: off
    faults: tuple[FaultOutcome, ...]
    attempts: tuple[AttemptRecord, ...]
    faulted: Accounting
    reference: Accounting
    unfinished: str | None  # why the faulted run did not finish; None when it did
    comparison: Comparison | None  # None when there was nothing to compare

    @property
    def unfired(self) -> list[FaultOutcome]:
        return [outcome for outcome in self.faults if outcome.fired is None]

    @property
    def misnamed(self) -> list[FaultOutcome]:
        """The slow and stall faults whose rank and host the launcher did not name."""
        return [o for o in self.faults if o.fault.kind in NAMED and not o.named_right]

    @property
    def lost_too_many(self) -> list[FaultOutcome]:
        """With in-memory checkpoints every k steps: the faults that ended an attempt and lost
        more than k steps."""
        k = self.memory_interval_steps
        return [
            o
            for o in self.faults
            if k > 0
            and o.fault.kind in ENDS_ATTEMPT
            and o.steps_lost is not None
            and o.steps_lost > k
        ]

    @property
    def not_from_partner(self) -> list[FaultOutcome]:
        """The host-loss faults that fired and whose restart did not load a partner's copy."""
        return [
            o
            for o in self.faults
            if o.fault.kind == "host-loss" and o.fired is not None and o.loaded_from != "partner"
        ]

    @property
    def passed(self) -> bool:
        return (
            self.unfinished is None
            and not self.unfired
            and not self.misnamed
            and not self.lost_too_many
            and not self.not_from_partner
            and self.comparison is not None
            and self.comparison.equal
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "output": self.output,
            "seed": self.seed,
            "num_ranks": self.num_ranks,
            "kinds": list(self.kinds),
            "notes": list(self.notes),
            "idle_timeout_s": self.idle_timeout_s,
            "memory_interval_steps": self.memory_interval_steps,
            "faults": [_outcome_json(outcome) for outcome in self.faults],
            "attempts": [record.to_json() for record in self.attempts],
            "goodput": {"faulted": self.faulted.as_json(), "straight": self.reference.as_json()},
            "unfinished": self.unfinished,
            "comparison": None if self.comparison is None else _comparison_json(self.comparison),
            "passed": self.passed,
        }


def write_report(path: Path, report: Report) -> None:
    write_json(path, report.to_json())


def _outcome_json(outcome: FaultOutcome) -> dict[str, Any]:
    fields = dataclasses.asdict(outcome)
    fault, fired = fields.pop("fault"), fields.pop("fired")
    return {**fault, "fired_step": fired["step"] if fired else None, **fields}


def _comparison_json(comparison: Comparison) -> dict[str, Any]:
    return {
        "equal": comparison.equal,
        "first_difference": comparison.first_difference,
        **{part: getattr(comparison, part) for part in PARTS},
    }


def format_report(report: Report) -> str:
    """The report as a person reads it: the faults, the attempts, goodput, the verdict."""
    lines = [
        f"chaos: {report.config}, {len(report.faults)} fault(s) of {', '.join(report.kinds)}, "
        f"seed {report.seed}, {report.num_ranks} rank(s); report in {report.output}",
        *(f"  note: {note}" for note in report.notes),
        "",
        *_fault_table(report.faults),
        "",
        *_attempt_table(report.attempts),
        "",
        *_goodput_lines(report.faulted, report.reference),
        "",
        *_verdict_lines(report),
    ]
    return "\n".join(lines)


def _fault_table(faults: Sequence[FaultOutcome]) -> list[str]:
    header = (
        "id", "kind", "rank", "step", "fired", "at", "attempt", "detection", "backoff",
        "start-up", "load", "1st step", "lost", "from", "recovery", "named",
    )  # fmt: skip
    rows = [header]
    for outcome in faults:
        fault, fired = outcome.fault, outcome.fired
        rows.append(
            (
                str(fault.id),
                fault.kind,
                str(fault.rank),
                str(fault.step),
                f"step {fired.step}" if fired else "NEVER",
                _seconds(outcome.at_s),
                _count(outcome.attempt),
                _seconds(outcome.detection_s),
                _seconds(outcome.backoff_s),
                _seconds(outcome.startup_s),
                _seconds(outcome.load_s),
                _seconds(outcome.first_step_s),
                _count(outcome.steps_lost),
                outcome.loaded_from or "-",
                _seconds(outcome.recovery_s),
                _named(outcome),
            )
        )
    return [
        "faults (times in seconds; from: where the attempt that came back loaded, snapshot, "
        "partner or checkpoint; recovery = fault -> first step back; named: the rank the "
        "launcher named, for slow and stall)",
        *_columns(rows),
    ]


def _named(outcome: FaultOutcome) -> str:
    if outcome.fault.kind not in NAMED:
        return "-"
    if outcome.named_rank is None:
        return "NO ONE"
    return f"rank {outcome.named_rank} on {outcome.named_host}" + (
        "" if outcome.named_right else " WRONG"
    )


def _attempt_table(attempts: Sequence[AttemptRecord]) -> list[str]:
    rows = [("attempt", "class", "exit", "steps", "gained", "wait", "evidence / reason")]
    for record in attempts:
        steps = f"{record.first_step}-{record.last_step}" if record.first_step else "-"
        why = "; ".join(item.said.splitlines()[-1][:80] for item in record.evidence)
        rows.append(
            (
                str(record.attempt),
                record.class_,
                str(record.exit_code),
                steps,
                str(record.steps_gained),
                _seconds(record.wait_s),
                "; ".join(filter(None, (why, record.reason))),
            )
        )
    return ["attempts (the faulted run's attempts.jsonl)", *_columns(rows)]


def _goodput_lines(faulted: Accounting, reference: Accounting) -> list[str]:
    """Both runs' goodput as ``goodput report`` counts it, and the faulted run's badput causes
    that cost anything, largest first."""
    causes = sorted(faulted.badput_s.items(), key=lambda item: -item[1])
    rest = ", ".join(f"{cause.replace('_', ' ')} {s:.2f} s" for cause, s in causes if s > 0)
    return [
        f"goodput {faulted.goodput:.1%} (straight run {reference.goodput:.1%}): "
        f"{faulted.productive_s:.2f} s productive in {faulted.wall_s:.2f} s "
        f"(straight run {reference.wall_s:.2f} s); {faulted.steps_kept} step(s) kept, "
        f"{faulted.steps_recomputed} run again",
        f"  badput by cause, as goodput report counts it: {rest or 'none'}",
        *(f"  {note}" for note in faulted.ignored_notes()),
    ]


def _verdict_lines(report: Report) -> list[str]:
    lines = []
    if report.unfinished is not None:
        lines.append(f"FAILED: {report.unfinished}")
    for outcome in report.unfired:
        lines.append(f"FAILED: {_fault_named(outcome)} never fired: the campaign did not test it")
    for outcome in report.misnamed:
        fault = outcome.fault
        named = (
            "no one"
            if outcome.named_rank is None
            else f"rank {outcome.named_rank} on {outcome.named_host}"
        )
        lines.append(
            f"FAILED: fault {fault.id} ({fault.kind} at step {fault.step} on rank {fault.rank} "
            f"on {outcome.host or 'an unknown host'}): the launcher named {named}"
        )
    lines += _memory_lines(report)
    comparison = report.comparison
    if comparison is not None and comparison.equal:
        lines.append(
            "final state against the straight run: bitwise equal (losses of every step run, "
            "weights, optimizer state, RNG state of every rank, train state)"
        )
    elif comparison is not None:
        lines.append("FAILED: final state against the straight run: DIFFERENT")
        for part in PARTS:
            difference = getattr(comparison, part)
            lines.append(f"  {part}: {'equal' if difference is None else difference}")
    return lines


def _memory_lines(report: Report) -> list[str]:
    """With in-memory checkpoints on: the faults that lost more than k steps, the host-loss
    faults not loaded from a partner's copy, or the line that says every one kept to its bound."""
    k = report.memory_interval_steps
    lines = []
    for outcome in report.lost_too_many:
        lines.append(
            f"FAILED: {_fault_named(outcome)}: {outcome.steps_lost} steps lost, more than "
            f"checkpoint.memory_interval_steps = {k}"
        )
    for outcome in report.not_from_partner:
        lines.append(
            f"FAILED: {_fault_named(outcome)}: the restart loaded from "
            f"{outcome.loaded_from or 'nowhere said'}, not from the lost host's partner copy"
        )
    ended = [o for o in report.faults if o.fault.kind in ENDS_ATTEMPT and o.steps_lost is not None]
    if k > 0 and ended and not lines:
        lines.append(
            f"memory snapshots every {k} step(s): each of the {len(ended)} fault(s) that ended "
            f"an attempt lost at most {k} step(s)"
        )
    return lines


def _fault_named(outcome: FaultOutcome) -> str:
    fault = outcome.fault
    return f"fault {fault.id} ({fault.kind} at step {fault.step} on rank {fault.rank})"


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)
