"""The attempts log, ``RUN/attempts.jsonl``: one ``AttemptRecord`` per launch attempt, appended by
the attempt loop (``retry``) and the only launch account a run report reads.

Each line is one JSON object with exactly these keys (none ever left out; null only where said):
  attempt              int >= 1: counts from 1 in each ``goodput launch`` (a job chain's next job
                       starts again at 1; ``job`` and ``started`` tell the launches apart)
  of                   int | null: the attempts allowed (``--retries`` + 1); null: no fixed limit
  job                  str | null: the Slurm or PBS job id; null outside a job
  class                success | walltime | interrupted | bad-node | hang | stuck-pre-training |
                       straggler | error (``failover.classify``)
  exit_code            int 0..255: the attempt's; a death by signal N reads 128 + N; 0 only for
                       a success, which exits 0 unless the trainer said the run was done and its
                       processes then failed or hung (124: the watchdog stopped them)
  timed_out            bool: the idle watchdog ended it
  first_failure_label  str | null: the label (rank, ``srun``, ...) of the first process that failed
  started              ISO 8601 UTC to the millisecond: before the attempt's processes started
  first_step_at        same, or null: when its first ``step=N`` line came
  ended                same: once every process was gone; started <= first_step_at <= ended
  steps_seen           int: ``step=N`` lines, from every process
  first_step           int | null: the lowest N seen (a resumed run starts past 1)
  last_step            int | null: the highest N seen; null exactly when steps_seen is 0
  steps_gained         int: steps this attempt made, by its step lines or the heartbeat file
  hosts                [str]: the hosts it ran on, in rank order
  evidence             [{host, said, source, rank, step}]: what named a host, suspects and
                       stragglers first; ``source`` is ``log`` (an output line named it),
                       ``probe`` (its health probe failed), ``hang-suspect`` (the hang's forensics
                       named a rank on it) or ``straggler`` (a rank on it was slow); ``rank`` and
                       ``step`` (int >= 0, or null) say which rank at which step, where known.
                       Evidence is not blame: a host is blamed only where ``replaced`` names it
                       (a suspect whose probe passed is named here and kept)
  replaced             {old: new}: hosts swapped for spares before the next attempt
  spares_left          [str]: spares still unused after those swaps
  decision             retry | stop
  reason               str | null: why it stopped; null exactly when the decision is retry
  wait_s               float | null: seconds waited before the next attempt; null on a stop
                       (0 when the next attempt is an in-process recovery of this one's processes)
  recovery             {rank, spare, generation, abort_s, rendezvous_s, fallback} | null: how
                       the attempt began when it recovered the one before in process
                       (``goodput launch --in-process``): the rank that died, the warm spare
                       that took its place, the new generation of process groups, the seconds
                       until every survivor left its step and until every rank's new group was
                       up; or ``fallback``, why it could not (the others null), after which it
                       ended as the attempt before did. null: it started its processes afresh;
                       a line of an older goodput has no key and reads as null
Lines are written whole (one ``write`` on an O_APPEND descriptor, fsynced), so a crash never
leaves half of one. ``read_attempts`` reads them back strictly: a line that is not exactly such a
record is refused with ``FILE:LINE``; an evidence item without ``rank`` and ``step`` (a line of an
older goodput) reads with both null. Standard library and goodput's own config checks only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from goodput.config import from_table, limits
from goodput.errors import GoodputError
from goodput.io import SMALL_FILE_BYTES, append_fd, json_text, read_lines

AttemptClass = Literal[
    "success",
    "walltime",
    "interrupted",
    "bad-node",
    "hang",
    "stuck-pre-training",
    "straggler",
    "error",
]
EvidenceSource = Literal["log", "probe", "hang-suspect", "straggler"]
# A record names every host of the attempt (up to launch.env.MAX_HOSTS) and what blamed ones said.
MAX_LINE_BYTES = SMALL_FILE_BYTES
FIX = "it is not an attempt record of this goodput (damaged, or another version's); move it aside"


@dataclass(frozen=True, slots=True)
class Evidence:
    host: str
    said: str  # the log line(s), the probe's answer, or the suspect's or straggler's line
    source: EvidenceSource
    # Which rank on ``host``, at which step; None where the source does not say (a probe).
    rank: int | None = dataclasses.field(default=None, metadata=limits(at_least=0))
    step: int | None = dataclasses.field(default=None, metadata=limits(at_least=0))


@dataclass(frozen=True, slots=True)
class Recovery:
    """``AttemptRecord.recovery``: an attempt that began by recovering the one before in process."""

    rank: int = dataclasses.field(metadata=limits(at_least=0))
    spare: int | None = dataclasses.field(default=None, metadata=limits(at_least=0))
    generation: int | None = dataclasses.field(default=None, metadata=limits(at_least=1))
    abort_s: float | None = dataclasses.field(default=None, metadata=limits(at_least=0))
    rendezvous_s: float | None = dataclasses.field(default=None, metadata=limits(at_least=0))
    fallback: str | None = None

    def __post_init__(self) -> None:
        timed = (self.spare, self.generation, self.abort_s, self.rendezvous_s)
        if (self.fallback is None) != all(value is not None for value in timed):
            raise _refused("a recovery has its spare, generation and times, or a fallback alone")


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptRecord:
    """One attempt, as the module docstring spells it; ``class_`` is the ``class`` key."""

    attempt: int = dataclasses.field(metadata=limits(at_least=1))
    of: int | None = dataclasses.field(metadata=limits(at_least=1))
    job: str | None
    class_: AttemptClass
    exit_code: int = dataclasses.field(metadata=limits(at_most=255))
    timed_out: bool
    first_failure_label: str | None
    started: str
    first_step_at: str | None
    ended: str
    steps_seen: int
    first_step: int | None
    last_step: int | None
    steps_gained: int
    hosts: tuple[str, ...]
    evidence: tuple[Evidence, ...]
    replaced: dict[str, str]
    spares_left: tuple[str, ...]
    decision: Literal["retry", "stop"]
    reason: str | None
    wait_s: float | None
    recovery: Recovery | None = None

    def __post_init__(self) -> None:
        """What a report relies on; at write time a failure here is a bug of the loop."""
        if self.of is not None and self.attempt > self.of:
            raise _refused(f"attempt {self.attempt} of {self.of}")
        # A success exits 0, unless the run said done and its processes then did not (class).
        if self.exit_code == 0 and self.class_ != "success":
            raise _refused(f"class {self.class_} with exit code {self.exit_code}")
        times = [_instant(self.started), _instant(self.ended)]
        if self.first_step_at is not None:
            times.insert(1, _instant(self.first_step_at))
        if times != sorted(times):
            raise _refused("started, first_step_at and ended are out of order")
        self._check_steps()
        self._check_hosts()
        stop = self.decision == "stop"
        if stop != (self.reason is not None) or stop != (self.wait_s is None):
            raise _refused("a stop has a reason and no wait_s, a retry a wait_s and no reason")

    def _check_steps(self) -> None:
        none_seen = (self.steps_seen == 0, self.first_step is None, self.last_step is None)
        if len(set(none_seen)) != 1:
            raise _refused("steps_seen, first_step and last_step disagree")
        first, last = self.first_step, self.last_step
        if first is not None and last is not None and first > last:
            raise _refused("first_step is past last_step")

    def _check_hosts(self) -> None:
        if not self.hosts:
            raise _refused("no hosts")
        if not {item.host for item in self.evidence} <= set(self.hosts):
            raise _refused("evidence names a host the attempt did not run on")
        if not isinstance(self.replaced, dict) or not all(
            type(old) is str and type(new) is str for old, new in self.replaced.items()
        ):
            raise _refused("'replaced' must map host names to host names")
        if not set(self.replaced) <= set(self.hosts):
            raise _refused("'replaced' names a host the attempt did not run on")
        if self.replaced and self.decision == "stop":
            raise _refused("hosts are replaced only for a next attempt")

    def to_json(self) -> dict[str, Any]:
        """The record as its line's JSON object: ``class``, and lists where it holds tuples."""
        return {
            _key(name): list(value) if isinstance(value, tuple) else value
            for name, value in dataclasses.asdict(self).items()
        }


def _key(name: str) -> str:
    return "class" if name == "class_" else name  # ``class`` is a Python keyword


def _refused(what: str) -> GoodputError:
    return GoodputError("attempt record", what, FIX)


def _instant(text: str) -> datetime:
    try:
        instant = datetime.fromisoformat(text)
    except ValueError:
        raise _refused(f"{text!r} is not an ISO 8601 time") from None
    if instant.utcoffset() is None:
        raise _refused(f"{text!r} has no time zone")
    return instant


def timestamp(instant: datetime) -> str:
    return instant.astimezone(UTC).isoformat(timespec="milliseconds")


def append_record(path: Path, record: AttemptRecord) -> None:
    """Append one complete JSON line durably: one ``write`` on an O_APPEND descriptor, fsynced."""
    line = (json_text(record.to_json(), where=path, sort_keys=True) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = append_fd(path)
    try:
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(f"short write to {path}: {written} of {len(line)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)


def read_attempts(path: Path) -> list[AttemptRecord]:
    """Every record of an attempts log, in order; any line that is not one: ``FILE:LINE``. Read
    line by line, each bounded (``io.read_lines``), from a regular file only."""
    records = []
    for number, line in read_lines(path, MAX_LINE_BYTES, fix=FIX):
        where = f"{path}:{number}"
        if not line.endswith(b"\n"):
            raise GoodputError(where, "has no newline: it was cut short", FIX)
        try:
            text = line[:-1].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GoodputError(where, f"is not UTF-8 (byte {exc.start})", FIX) from None
        records.append(parse_record(text, where))
    return records


def parse_record(line: str, where: str) -> AttemptRecord:
    """One line as a record, or a ``GoodputError`` naming ``where``."""
    try:
        raw = json.loads(line)
    except (ValueError, RecursionError):
        raise GoodputError(where, "is not a JSON line", FIX) from None
    if not isinstance(raw, dict) or "class_" in raw:
        raise GoodputError(where, "is not an object of attempt record keys", FIX)
    fields = {("class_" if key == "class" else key): value for key, value in raw.items()}
    try:
        return from_table(AttemptRecord, fields, where)
    except GoodputError as error:
        raise GoodputError(where, error.what.replace("'class_'", "'class'"), FIX) from None
