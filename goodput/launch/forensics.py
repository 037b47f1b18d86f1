"""Hang forensics on one host: every rank's beacon, process state and main-thread stack, read
when the idle watchdog fires and before the ranks are stopped (``suspects`` compares them).

``collect_host`` (in the launcher's process for a local launch, else ``python -m
goodput.launch.forensics collect --dir D`` on each host, all in one step of the job's own srun
or mpiexec, ``fanout``):
  1. every beacon in the attempt's folder is read (``beacon.read_beacon``: strict, bounded);
  2. each beacon's pid is proven ours (its ``/proc/PID/stat`` start time equals the beacon's
     ``start_ticks``, and this user owns it) and its state read: T stopped, D stuck in the
     kernel, Z or missing (or another process under a reused pid) gone;
  3. ``beacon.DUMP_SIGNAL`` goes to each pid proven ours that is not stopped or gone, through
     a pidfd opened before the proof (no pid-reuse race), never to a process group: a
     data-loader worker would die of SIGUSR2's default action;
  4. up to ``wait_s`` for each stack file to grow, then a moment for it to settle;
  5. the new text is parsed: the main thread's (``main_thread_id``) top ``TOP_FRAMES`` frames,
     each ``file.py:line func``;
  6. the answer is one JSON object of at most ``MAX_REPORT_BYTES`` (the waiters' stacks are
     dropped first, then every stack, then ranks, to fit), which ``read_report`` parses back
     strictly: whatever a host or a rank wrote is hostile until checked.
Standard library only (launch/ never imports torch); it signals nothing but proven pids and
writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import stat
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal, NoReturn

from goodput import beacon
from goodput.config import from_table, limits
from goodput.errors import GoodputError, one_line, printable
from goodput.io import NotOwnFile, open_own_file
from goodput.launch import launchers

ProcState = Literal["running", "stopped", "disk-sleep", "gone"]
DUMP_WAIT_S = 3.0  # faulthandler writes within milliseconds; a rank silent this long is stuck
SETTLE_S = 0.1  # a stack file unchanged this long is written
POLL_S = 0.02
TOP_FRAMES = 3
MAX_REPORT_BYTES = 64 << 10
MAX_STACK_BYTES = 256 << 10  # one dump of every thread; the main thread's block comes early
MAX_STACK_LINES = 20_000
MAX_STACK_LINE_CHARS = 5000
MAX_FRAME_CHARS = 160
MAX_ENTRIES = 4 * launchers.MAX_PPN + 64  # beacon, stack and temporary files of a full host
MAX_PROBLEMS = 20
MAX_PROBLEM_CHARS = 200
MAX_COUNT = 2**63 - 1
BEACON_NAME = re.compile(r"rank-[0-9]{5,8}\.beacon")
THREAD_LINE = re.compile(
    r"(?:Current thread|Thread) 0x([0-9a-fA-F]{1,16})(?: [^\n]{0,200})? \(most recent call first\):"
)
FRAME_LINE = re.compile(r'  File "([^\n]{1,4096})", line ([0-9]{1,9}) in ([^\n]{1,512})')
STATES: dict[str, ProcState] = {"T": "stopped", "t": "stopped", "D": "disk-sleep"}
GONE_STATES = frozenset("ZXx")
FIX = "it is not a forensics report of this goodput; check the host's goodput installation"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReport:
    """One rank as its host saw it: its beacon, its process state, its main thread's frames."""

    rank: int = field(metadata=limits(at_most=beacon.MAX_WORLD))
    world_size: int = field(metadata=limits(at_least=1, at_most=beacon.MAX_WORLD))
    pid: int = field(metadata=limits(at_least=1, at_most=beacon.MAX_PID))
    schedule_id: int = field(metadata=limits(at_most=2**64 - 1))
    step: int = field(metadata=limits(at_most=MAX_COUNT))
    phase: str
    last_site: str
    entered: int = field(metadata=limits(at_most=MAX_COUNT))
    left: int = field(metadata=limits(at_most=MAX_COUNT))
    flush_site: str
    flush_entered: int = field(metadata=limits(at_most=MAX_COUNT))
    flush_left: int = field(metadata=limits(at_most=MAX_COUNT))
    torn: bool
    state: ProcState
    answered: bool  # it wrote a stack when asked
    stack: tuple[str, ...] = ()  # the main thread's top frames, innermost first

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise _refused(f"rank {self.rank} of world {self.world_size}")
        if self.phase not in beacon.PHASES:
            raise _refused(f"phase {self.phase!r}")
        if {self.last_site, self.flush_site} - {"", *beacon.SITES}:
            raise _refused(f"site {self.last_site!r} or {self.flush_site!r}")
        if len(self.stack) > TOP_FRAMES or not all(map(_is_frame, self.stack)):
            raise _refused("a stack that is not up to 3 printable frames")

    @property
    def waiting(self) -> bool:
        """Inside a collective of the training thread."""
        return self.entered > self.left


@dataclass(frozen=True, slots=True, kw_only=True)
class HostReport:
    """What one host's ``collect`` found; ``omitted``: ranks left out to fit the size bound."""

    ranks: tuple[RankReport, ...] = ()
    problems: tuple[str, ...] = ()  # files that were no beacon, a folder that was missing
    omitted: int = field(default=0, metadata=limits(at_most=MAX_ENTRIES))

    def __post_init__(self) -> None:
        if len(self.problems) > MAX_PROBLEMS or not all(map(_is_problem, self.problems)):
            raise _refused(f"more than {MAX_PROBLEMS} problems, or one not a printable line")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def _is_frame(text: str) -> bool:
    return len(text) <= MAX_FRAME_CHARS and text.isprintable()


def _is_problem(text: str) -> bool:
    return len(text) <= MAX_PROBLEM_CHARS and text.isprintable()


def _refused(what: str) -> GoodputError:
    return GoodputError("forensics report", f"not a report: {what}", FIX)


# --- collecting on one host -----------------------------------------------------------------


def collect_host(directory: Path, wait_s: float = DUMP_WAIT_S) -> HostReport:
    """Every beacon in ``directory`` with its process state and main-thread frames (the module
    docstring's steps 1-6); a folder that is missing or not this user's is a problem, no rank."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return HostReport(problems=(_problem(f"{directory}: no beacon folder on this host"),))
    except OSError as error:
        return HostReport(problems=(_problem(f"{directory}: {error.strerror or error}"),))
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return HostReport(problems=(_problem(f"{directory}: not a folder of this user"),))
    states, problems = _read_beacons(directory)
    proc_states: dict[int, ProcState] = {}
    signalled: dict[int, int] = {}  # rank -> its stack file's size before the signal
    for state in states:
        size = _stack_size(beacon.stack_path(directory, state.rank))
        proc_states[state.rank], sent = _dump_if_ours(state, size is not None)
        if sent and size is not None:
            signalled[state.rank] = size
    texts = _wait_for_stacks(directory, signalled, wait_s)
    ranks = [
        _rank_report(state, proc_states[state.rank], texts.get(state.rank)) for state in states
    ]
    return bounded(HostReport(ranks=tuple(ranks), problems=tuple(problems[:MAX_PROBLEMS])))


def _problem(text: str) -> str:
    return printable(one_line(text, MAX_PROBLEM_CHARS), MAX_PROBLEM_CHARS)


def _read_beacons(directory: Path) -> tuple[list[beacon.BeaconState], list[str]]:
    states: dict[int, beacon.BeaconState] = {}
    problems: list[str] = []
    with os.scandir(directory) as entries:
        for count, entry in enumerate(entries):
            if count == MAX_ENTRIES:
                problems.append(_problem(f"{directory}: more than {MAX_ENTRIES} entries"))
                break
            if not BEACON_NAME.fullmatch(entry.name):
                continue
            try:
                state = beacon.read_beacon(entry.path)
            except GoodputError as error:
                problems.append(_problem(f"{entry.name}: {error.what}"))
                continue
            if beacon.beacon_path(directory, state.rank).name != entry.name:
                problems.append(_problem(f"{entry.name}: holds rank {state.rank}'s beacon"))
            elif state.rank in states:  # unreachable by name; kept for a clear invariant
                problems.append(_problem(f"{entry.name}: rank {state.rank} twice"))
            else:
                states[state.rank] = state
    return [states[rank] for rank in sorted(states)], problems


def _dump_if_ours(state: beacon.BeaconState, has_stack_file: bool) -> tuple[ProcState, bool]:
    """The state of the beacon's process, and whether it was sent the dump signal: only if it is
    the rank (``proc_state``), can act on it (not stopped or gone) and has a stack file. The
    pidfd is opened before the check, so the signal reaches the process checked, or none."""
    pidfd = None
    with contextlib.suppress(OSError, AttributeError):  # no pidfd_open: Linux < 5.3, or not Linux
        pidfd = os.pidfd_open(state.pid)
    try:
        found = proc_state(state.pid, state.start_ticks)
        if found in ("stopped", "gone") or not has_stack_file:
            return found, False
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, beacon.DUMP_SIGNAL)
            else:
                os.kill(state.pid, beacon.DUMP_SIGNAL)
        except OSError:
            return found, False
        return found, True
    finally:
        if pidfd is not None:
            os.close(pidfd)


def proc_state(pid: int, start_ticks: int) -> ProcState:
    """The state of ``pid`` if it is the process that wrote the beacon (same start time, this
    user's), else ``gone``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            text = file.read(4096)
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return "gone"
    try:
        # comm, in parentheses, may hold spaces and parentheses itself: split after the last.
        fields = text[text.rindex(b")") + 2 :].split()
        state, started = fields[0].decode("ascii"), int(fields[19])
    except (ValueError, IndexError, UnicodeDecodeError):
        return "gone"
    if started != start_ticks or owner != os.getuid() or state in GONE_STATES:
        return "gone"
    return STATES.get(state, "running")


def _stack_size(path: Path) -> int | None:
    """The size of the stack file if it is a regular file of this user's, else None."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        return None
    return info.st_size


def _wait_for_stacks(directory: Path, before: Mapping[int, int], wait_s: float) -> dict[int, str]:
    """The text each rank's stack file gained, once it grew and settled (or the time is up)."""
    deadline = time.monotonic() + wait_s
    sizes: dict[int, tuple[int, float]] = {}  # rank -> (size, since when unchanged)
    while True:
        now = time.monotonic()
        for rank, start in before.items():
            size = _stack_size(beacon.stack_path(directory, rank)) or 0
            if size > start and sizes.get(rank, (-1, 0.0))[0] != size:
                sizes[rank] = (size, now)
        settled = all(rank in sizes and now - sizes[rank][1] >= SETTLE_S for rank in before)
        if settled or now >= deadline:
            break
        time.sleep(POLL_S)
    return {rank: _read_stack(beacon.stack_path(directory, rank), before[rank]) for rank in sizes}


def _read_stack(path: Path, offset: int) -> str:
    try:
        fd, _ = open_own_file(path)
    except NotOwnFile:
        return ""
    try:
        return os.pread(fd, MAX_STACK_BYTES, offset).decode("utf-8", "replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def parse_stack(text: str, thread_id: int) -> tuple[str, ...]:
    """The top ``TOP_FRAMES`` frames of thread ``thread_id`` in faulthandler's dump ``text``,
    innermost first, each ``file.py:line func``; () when that thread is not in it."""
    frames: list[str] = []
    inside = False
    for count, line in enumerate(text.splitlines()):
        if count == MAX_STACK_LINES or len(frames) == TOP_FRAMES:
            break
        if len(line) > MAX_STACK_LINE_CHARS:
            continue
        thread = THREAD_LINE.fullmatch(line)
        if thread is not None:
            if inside:
                break  # the main thread's block ended
            inside = int(thread[1], 16) == thread_id
            continue
        frame = FRAME_LINE.fullmatch(line) if inside else None
        if frame is not None:
            name = frame[1].rsplit("/", 1)[-1]
            frames.append(printable(f"{name[:60]}:{frame[2]} {frame[3][:60]}", MAX_FRAME_CHARS))
    return tuple(frames)


def _rank_report(state: beacon.BeaconState, proc: ProcState, text: str | None) -> RankReport:
    return RankReport(
        rank=state.rank,
        world_size=state.world_size,
        pid=state.pid,
        schedule_id=state.schedule_id,
        step=state.step,
        phase=state.phase,
        last_site=state.last_site,
        entered=state.entered,
        left=state.left,
        flush_site=state.flush_site,
        flush_entered=state.flush_entered,
        flush_left=state.flush_left,
        torn=state.torn,
        state=proc,
        answered=text is not None,
        stack=parse_stack(text or "", state.main_thread_id),
    )


def bounded(report: HostReport) -> HostReport:
    """``report`` within ``MAX_REPORT_BYTES``: the waiters' stacks go first (the suspect is
    rarely one), then every stack, then ranks from the end."""
    if len(report.to_json()) <= MAX_REPORT_BYTES:
        return report
    ranks = [replace(r, stack=()) if r.waiting else r for r in report.ranks]
    report = replace(report, ranks=tuple(ranks))
    if len(report.to_json()) > MAX_REPORT_BYTES:
        report = replace(report, ranks=tuple(replace(r, stack=()) for r in ranks))
    while len(report.to_json()) > MAX_REPORT_BYTES and report.ranks:
        keep = len(report.ranks) * 3 // 4
        report = replace(
            report,
            ranks=report.ranks[:keep],
            omitted=report.omitted + len(report.ranks) - keep,
        )
    return report


def read_report(text: str | bytes) -> HostReport:
    """A host's ``collect`` answer, strictly checked; anything else is a GoodputError."""
    if len(text) > MAX_REPORT_BYTES:
        raise _refused(f"{len(text)} bytes, more than {MAX_REPORT_BYTES}")
    try:
        raw = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError too
        raise _refused(f"not JSON ({one_line(str(error), 100)})") from None
    if not isinstance(raw, dict):
        raise _refused("not a JSON object")
    return from_table(HostReport, raw, "forensics report")


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


# --- python -m goodput.launch.forensics collect --dir D ----------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise GoodputError.usage(self.prog, message, "see --help")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m goodput.launch.forensics", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    collect = commands.add_parser("collect", help="print this host's ranks as JSON")
    collect.add_argument("--dir", required=True, type=Path, help="the attempt's beacon folder")
    collect.add_argument("--wait-s", type=float, default=DUMP_WAIT_S)
    try:
        args = parser.parse_args(argv)
        if not args.dir.is_absolute() or not 0 <= args.wait_s <= 60:
            raise GoodputError.usage(
                parser.prog, "--dir must be absolute, --wait-s from 0 to 60", "see --help"
            )
    except GoodputError as error:
        print(f"forensics: {error.render()}", file=sys.stderr)
        return int(error.code)
    print(collect_host(args.dir, args.wait_s).to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
