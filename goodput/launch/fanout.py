"""One command on many hosts at once from the launch node, bounded: the health probes
(``failover.probe_hosts``) and the hang forensics (``suspects.collect_hosts``) both reach their
hosts through ``reach``, which gives each host its ``Answer``.

How hosts are reached depends on the plan's launcher:
  - slurm and pbs: one step of the job's own launcher over all of them, one task per host
    (``srun --nodes N --ntasks N --ntasks-per-node 1 --nodelist FILE``, with ``--overlap`` for
    forensics; ``mpiexec -n N -ppn 1 -hostfile FILE``; ``launchers.build_host_command``). The
    scheduler's own tree starts the tasks and carries their output back: one request to the
    Slurm controller (one PALS or Hydra launch) whatever the host count. A command per host
    is a request per host — 10,624 at the moment something went wrong, the pattern Slurm
    sites forbid — and even 64 at a time it is 166 rounds of srun's start-up (about a second
    each) that no health timeout covers. Each task runs this module (``python -m
    goodput.launch.fanout``): it runs the command, bounds its output and time, prints the
    answer as tagged lines (below) and exits 0 whatever the command did, since a task failing
    would make Hydra, PALS or a site's ``KillOnBadExit`` stop every other host's task.
  - local: every host is this machine (a local plan has one); the commands run here, each a
    child of the launcher: there is no scheduler step to share, so bounded concurrency.
A step that leaves hosts without an answer (Slurm refuses a step naming a down node; a launch
that fails on one node aborts the step) is split in halves, each retried as a step while time
is left, down to single hosts: k bad hosts among N cost about 2k·log2(N/k) steps, and every
host's answer is its own — a one-host step's failure (the last line and exit status of its srun
or mpiexec) is that host's answer, as a command per host gave it. A step that exits 0 with no
answer from anyone failed the same way everywhere (its tasks could not tag their answers) and
is not split, nor is any once ``MAX_STEPS`` have started (a failure alike in every step): its
hosts take the step's failure as their answer.

Bounds: at most ``MAX_CHILDREN`` children (steps or commands) at once on the launch node; each
host's answer at most ``max_bytes`` of output (its head; or with ``tail`` its last bytes, read to
the end: a probe's verdict is its last line); all of it within ``timeout_s``. On each node the
command is stopped a margin before the deadline (a quarter of the time, at most
``MAX_MARGIN_S``), so that its "no answer" still comes back; at the deadline the launcher
kills whatever is left, with its process group.

Tagged lines (``frame_lines``, read back by ``Frames``): ``goodput-fanout TAG CODE CUT
PART/PARTS DATA``. TAG is what the task's own launcher told it it is (``TASK_VARS``: Slurm's
``SLURMD_NODENAME``, the node's name; MPICH Hydra's ``PMI_RANK``, Cray PALS' ``PALS_RANKID``: its
host's line in the host file); CODE the command's exit status, ``-`` for none in time; CUT 1
when the output was cut to the bound; DATA a base64 piece of at most ``CHUNK_BYTES``. Each line
is one write shorter than ``LINE_BYTES``, so no launcher splits it among other tasks' lines.
A host's answer is the complete set of its parts under one header; lines that are malformed,
past the bound, tagged with no host of the step, or contradicting another line for the same
host answer for nobody: a host is answered by lines with its own tag only, never another's.
Standard library only.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import collections
import contextlib
import dataclasses
import os
import queue
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from goodput.errors import GoodputError, one_line
from goodput.launch import launchers
from goodput.launch.attempt import (
    AFTER_KILL_WAIT_S,
    READ_BYTES,
    ProcessSpec,
    cannot_start,
    start_process,
)
from goodput.launch.env import read_hostfile
from goodput.ranks import HOSTNAME, PROBE_HOST_VAR

# Children of the launcher at once: steps (slurm, pbs) or commands (local).
MAX_CHILDREN = 64
# Steps one ``reach`` starts at most. Finding 16 down hosts among 10,624 takes about 300; a
# failure alike in every step (a bad option, a launcher refusing any step) would otherwise be
# split down to a step per host, and is that host's answer anyway.
MAX_STEPS = 512
MAGIC = b"goodput-fanout"
CHUNK_BYTES = 384  # of a command's output per line: 512 characters of base64
LINE_BYTES = 1024  # a line this long is no answer line (a tag is at most 253 characters)
# The time a task's answer has to come back after its command is stopped: the node's Python
# start and the scheduler's forwarding.
MAX_MARGIN_S = 10.0
MARGIN_SHARE = 0.25
OTHER_LINES = 16  # what a step printed besides its tasks' answers (srun's errors): the last kept
# What each launcher sets in a task to say which one it is; "host": it is the host's name, else
# its place in the step's host file.
TASK_VARS = {
    "slurm": ("host", "SLURMD_NODENAME"),
    "hydra": ("rank", "PMI_RANK"),
    "pals": ("rank", "PALS_RANKID"),
}
_CODE = re.compile(rb"-|-?[0-9]{1,3}")
_PART = re.compile(rb"([0-9]{1,9})/([0-9]{1,9})")


@dataclass(frozen=True, slots=True)
class Answer:
    """One host's answer: its command's exit status (None: none within the time, or no answer
    at all), what it printed (at most the bound), and whether that was cut to the bound."""

    code: int | None
    output: bytes = b""
    cut: bool = False


NO_ANSWER = Answer(None)


# --- the tagged lines ---------------------------------------------------------------------------


def frame_lines(tag: str, answer: Answer) -> list[bytes]:
    """``answer`` as the lines a task prints, tagged ``tag``."""
    output = answer.output
    parts = [output[i : i + CHUNK_BYTES] for i in range(0, len(output), CHUNK_BYTES)] or [b""]
    code = "-" if answer.code is None else str(answer.code)
    head = b"%s %s %s %d " % (MAGIC, tag.encode(), code.encode(), answer.cut)
    return [
        b"%s%d/%d %s\n" % (head, index, len(parts), base64.b64encode(part))
        for index, part in enumerate(parts)
    ]


@dataclass(frozen=True, slots=True)
class _Line:
    tag: str
    head: tuple[int | None, bool, int]  # code, cut, parts
    part: int
    data: bytes


def _parse(line: bytes, most_parts: int) -> _Line | None:
    """One tagged line (anything before the magic word is a launcher's label), or None."""
    start = line.find(MAGIC + b" ")
    fields = line[start:].split() if start >= 0 and len(line) <= LINE_BYTES else []
    if len(fields) == 5:  # no output: its piece is empty
        fields.append(b"")
    if len(fields) != 6:
        return None
    _, tag, code, cut, part, data = fields
    numbers = _PART.fullmatch(part)
    if not (HOSTNAME.fullmatch(tag.decode("ascii", "replace")) and _CODE.fullmatch(code)):
        return None
    if cut not in (b"0", b"1") or numbers is None:
        return None
    index, parts = int(numbers[1]), int(numbers[2])
    if not index < parts <= most_parts:
        return None
    try:
        decoded = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(decoded) > CHUNK_BYTES:
        return None
    status = None if code == b"-" else int(code)
    return _Line(tag.decode(), (status, cut == b"1", parts), index, decoded)


class Frames:
    """The answers in one step's output, fed one line at a time (without its newline):
    ``tags`` maps each task's tag to its host. ``answers()``: the hosts answered, each with its
    own; ``other``: the step's last lines that were no answer (its launcher's own messages)."""

    def __init__(self, tags: Mapping[str, str], max_bytes: int) -> None:
        self.tags = dict(tags)
        self.max_bytes = max_bytes
        self.most_parts = max(1, -(-max_bytes // CHUNK_BYTES))
        self.heads: dict[str, tuple[int | None, bool, int]] = {}
        self.parts: dict[str, dict[int, bytes]] = {}
        self.conflicted: set[str] = set()
        self.other: collections.deque[bytes] = collections.deque(maxlen=OTHER_LINES)

    def feed(self, line: bytes) -> None:
        if MAGIC not in line:
            self.other.append(line[:LINE_BYTES])
            return
        parsed = _parse(line, self.most_parts)
        host = None if parsed is None else self.tags.get(parsed.tag)
        if parsed is None or host is None or host in self.conflicted:
            return
        known = self.parts.setdefault(host, {})
        head = self.heads.setdefault(host, parsed.head)
        if head != parsed.head or known.get(parsed.part, parsed.data) != parsed.data:
            # Two answers for one host: one of them is another task's, and which is unknown.
            self.conflicted.add(host)
            del self.parts[host], self.heads[host]
            return
        known[parsed.part] = parsed.data

    def answers(self) -> dict[str, Answer]:
        found = {}
        for host, (code, cut, parts) in self.heads.items():
            known = self.parts[host]
            if len(known) == parts:
                output = b"".join(known[index] for index in range(parts))
                if len(output) <= self.max_bytes:
                    found[host] = Answer(code, output, cut)
        return found


# --- running a process, bounded -----------------------------------------------------------------


def _start(argv: Sequence[str], env: Mapping[str, str], stderr: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(argv),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        start_new_session=True,  # so its whole group can be killed, helpers and grandchildren
    )


def _chunks(process: subprocess.Popen[bytes], deadline: float) -> Iterator[bytes]:
    """What ``process`` writes to its stdout, until its end or ``deadline``."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not selector.select(left):
                continue
            chunk = os.read(fd, READ_BYTES)
            if not chunk:
                return
            yield chunk


def _finish(process: subprocess.Popen[bytes], deadline: float) -> int | None:
    """``process``'s exit status once it ends by ``deadline`` (None if it did not); whatever
    of its group is left is killed either way."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(max(0.0, deadline - time.monotonic()))
    code = process.returncode
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(AFTER_KILL_WAIT_S)
    assert process.stdout is not None
    process.stdout.close()
    return code


def run_bounded(
    argv: Sequence[str],
    env: Mapping[str, str],
    timeout_s: float,
    max_bytes: int,
    *,
    tail: bool = False,
    stderr: bool = False,
) -> Answer:
    """Run ``argv`` and give its answer: its stdout (``stderr``: and stderr) and exit status.
    More than ``max_bytes`` stops it at once (the head is kept, ``cut``), or with ``tail``
    keeps the last ``max_bytes`` while it runs on; past ``timeout_s`` it gave no answer. Its
    group is killed when it ends or is stopped. OSError: it could not start."""
    process = _start(argv, env, subprocess.STDOUT if stderr else subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    output, cut = bytearray(), False
    for chunk in _chunks(process, deadline):
        output += chunk
        if len(output) > max_bytes:
            cut = True
            if not tail:
                del output[max_bytes:]
                break
            del output[:-max_bytes]
    flooded = cut and not tail
    code = _finish(process, time.monotonic() if flooded else deadline)
    # A flood was stopped here: its status is the kill's, and the answer says it was cut.
    return Answer(process.returncode if flooded else code, bytes(output), cut)


def _run_step(spec: ProcessSpec, frames: Frames, deadline: float, fix: str) -> int | None:
    """Run one step, feeding its output lines (at most ``LINE_BYTES``; longer ones are dropped)
    to ``frames``, and no more than its tasks' answers can take; its exit status, None when it
    was still running at ``deadline``. A step that cannot start is a usage error saying
    ``fix``."""
    process = start_process(spec, fix)
    most = (len(frames.tags) * (frames.most_parts + 1) + OTHER_LINES) * LINE_BYTES
    pending, skipping, total = b"", False, 0
    for chunk in _chunks(process, deadline):
        total += len(chunk)
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if not skipping:
                frames.feed(line)
            skipping = False
        if len(pending) > LINE_BYTES:  # no answer line: passed over up to its newline
            pending, skipping = b"", True
        if total > most:
            return _finish(process, time.monotonic())
    if pending and not skipping:
        frames.feed(pending)
    return _finish(process, deadline)


# --- reaching the hosts -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Done:
    hosts: tuple[str, ...]
    answers: dict[str, Answer]  # the hosts answered
    code: int | None = None  # the step's exit status (None: stopped at the deadline)
    said: bytes = b""  # the step's own last lines
    error: GoodputError | None = None  # it could not start


def _task_names(
    plan: launchers.LaunchPlan, hosts: tuple[str, ...]
) -> tuple[list[str], dict[str, str]]:
    """The options telling a task how its launcher names it, and each tag's host. A rank
    learns its host's name from the step's host file, written for mpiexec (a run folder on
    the shared file system; where a node cannot read it, its command is not told its name)."""
    kind, var = TASK_VARS["slurm" if plan.scheduler == "slurm" else plan.profile.mpiexec]
    if kind == "host":
        return [f"--host-var={var}"], {host: host for host in hosts}
    options = [f"--rank-var={var}"]
    if len(hosts) > 1:  # one host is told its name by mpiexec itself
        options.append(f"--hostfile={dataclasses.replace(plan, hosts=hosts).hostfile}")
    return options, {str(index): host for index, host in enumerate(hosts)}


def reach(
    plan: launchers.LaunchPlan,
    hosts: Sequence[str],
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    timeout_s: float,
    max_bytes: int,
    fix: str,
    tail: bool = False,
    stderr: bool = False,
    overlap: bool = False,
) -> dict[str, Answer]:
    """Every host's answer to ``argv`` (the module docstring says how), within ``timeout_s``;
    ``max_bytes``, ``tail``, ``stderr``: as ``run_bounded``; ``overlap``: beside the attempt's
    own step (``launchers.build_host_command``). A child that cannot start is a usage error
    saying ``fix``."""
    deadline = time.monotonic() + timeout_s
    margin = min(MAX_MARGIN_S, MARGIN_SHARE * timeout_s)
    results: queue.Queue[_Done] = queue.Queue()

    def local(host: str) -> _Done:
        spec = launchers.build_host_command(plan, (host,), argv, env)
        left = deadline - time.monotonic()
        try:
            answer = run_bounded(spec.argv, spec.env, left, max_bytes, tail=tail, stderr=stderr)
        except OSError as error:
            raise cannot_start(spec, error, fix) from None
        return _Done((host,), {host: answer})

    def step(group: tuple[str, ...]) -> _Done:
        options, tags = _task_names(plan, group)
        left = deadline - time.monotonic() - margin
        wrapper = [sys.executable, "-m", __name__, f"--timeout={left:.3f}", f"--bytes={max_bytes}"]
        wrapper += [*options, *(["--tail"] * tail), *(["--stderr"] * stderr)]
        if len(group) > 1:
            launchers.write_hostfile(plan, group)
        command = [*wrapper, "--", *argv]
        spec = launchers.build_host_command(plan, group, command, env, overlap=overlap)
        frames = Frames(tags, max_bytes)
        code = _run_step(spec, frames, deadline, fix)
        return _Done(group, frames.answers(), code, b"\n".join(frames.other))

    def work(job: tuple[str, ...]) -> None:
        try:
            done = local(job[0]) if plan.scheduler == "local" else step(job)
        except GoodputError as error:
            done = _Done(job, {}, error=error)
        results.put(done)

    todo = collections.deque(
        [(host,) for host in hosts] if plan.scheduler == "local" else [tuple(hosts)]
    )
    answers: dict[str, Answer] = {}
    failed: GoodputError | None = None
    running = started = 0
    while todo or running:
        while todo and running < MAX_CHILDREN and failed is None:
            threading.Thread(target=work, args=(todo.popleft(),), daemon=True).start()
            running += 1
            started += 1
        if not running:
            break
        done = results.get()
        running -= 1
        failed = failed or done.error
        answers.update(done.answers)
        silent = tuple(host for host in done.hosts if host not in done.answers)
        # Split while the halves' tasks still get time and steps are left, unless the step ran
        # and no one could answer: then a smaller one would fail the same way.
        split = len(silent) > 1 and deadline - time.monotonic() > margin
        split = split and started + len(todo) + 2 <= MAX_STEPS
        if split and (done.answers or done.code not in (0, None)):
            half = len(silent) // 2
            todo.extend((silent[:half], silent[half:]))
        else:
            code = None if done.code == 0 else done.code
            answers.update(dict.fromkeys(silent, Answer(code, done.said)))
    if failed is not None:
        raise failed
    return {host: answers.get(host, NO_ANSWER) for host in hosts}


# --- the task on each node ----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise GoodputError.usage(self.prog, message, "see --help")


def task_parser() -> argparse.ArgumentParser:
    """The options of a task (``main``), as ``reach`` gives them."""
    parser = _Parser(prog="python -m goodput.launch.fanout", description=main.__doc__)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--bytes", type=int, required=True)
    named = parser.add_mutually_exclusive_group(required=True)
    named.add_argument("--host-var", help="the variable naming this task's host")
    named.add_argument("--rank-var", help="the variable giving this task's host's place")
    parser.add_argument("--hostfile", help="with --rank-var: the step's hosts, one a line")
    parser.add_argument("--tail", action="store_true", help="keep the last bytes")
    parser.add_argument("--stderr", action="store_true", help="answer with stderr too")
    parser.add_argument("command", nargs="+")
    return parser


def main(argv: list[str] | None = None) -> int:
    """A task of a step: run the command after ``--`` and print its answer, tagged."""
    try:
        args = task_parser().parse_args(argv)
    except GoodputError as error:
        print(f"fanout: {error.render()}", file=sys.stderr)
        return int(error.code)
    var = args.host_var or args.rank_var
    tag = os.environ.get(var, "")
    if not HOSTNAME.fullmatch(tag):
        # Exit 0 still: a failed task would stop the other hosts' tasks.
        print(f"fanout: ${var} is {one_line(repr(tag), 80)}, no task's name", file=sys.stderr)
        return 0
    env = dict(os.environ)
    if args.host_var:
        env.setdefault(PROBE_HOST_VAR, tag)
    elif args.hostfile and tag.isdecimal():
        with contextlib.suppress(GoodputError):
            hosts = read_hostfile(args.hostfile)
            if int(tag) < len(hosts):
                env[PROBE_HOST_VAR] = hosts[int(tag)]
    try:
        answer = run_bounded(
            args.command, env, args.timeout, args.bytes, tail=args.tail, stderr=args.stderr
        )
    except OSError as error:
        answer = Answer(127, f"cannot start {args.command[0]}: {error.strerror}".encode())
    for line in frame_lines(tag, answer):
        os.write(sys.stdout.fileno(), line)  # one write a line: never split among others'
    return 0


if __name__ == "__main__":
    sys.exit(main())
