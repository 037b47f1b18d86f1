"""Why an attempt failed, how far it got, and which hosts to suspect or blame (``goodput launch
--auto-retry``): the attempt loop (``retry``) asks this module for each attempt's class, its
progress and the evidence against hosts, and swaps the blamed hosts for spares with ``Pool``.

Each attempt gets one class, from its exit code, its progress (``step=N`` lines and the
``heartbeat`` file: steps gained this attempt) and its HOST evidence:
  - ``success``: exit 0;
  - ``interrupted``: Ctrl-C (130);
  - ``walltime``: 143, the allocation is ending (the launcher itself got SIGTERM, or the ranks
    did with no host evidence);
  - ``bad-node``: an output line is host evidence against a host of the pool (or, decided
    by ``retry`` after a crash, a suspect failed its health probe);
  - ``hang``: the idle watchdog fired (124); a hang suspect (``AttemptResult.suspects``) is
    evidence, never host evidence: the attempt stays a hang whatever its forensics named;
  - ``straggler``: the trainer stopped after a save to have a straggler's host replaced (exit 4,
    ``--evict-stragglers``);
  - ``stuck-pre-training``: no step this attempt;
  - ``error``: any other failure.

Output lines are evidence of two kinds, each a list of patterns (data; the code only applies
them) whose ``host`` group names a host, or whose ``addr`` group gives an address to resolve:
  - HOST evidence (``BAD_NODE_PATTERNS`` plus the profile's ``bad_node_patterns``): the host
    itself failed — its device, or the node as its scheduler or MPI launcher saw it. It is
    enough to evict the host;
  - PEER evidence (``PEER_PATTERNS``): a process on that host went away — a peer closed its
    connection, a rank there exited with an error. Processes die on healthy hosts (a bug, an
    exception, a kill), so this only makes the host a suspect for ``probe_hosts``, which runs
    the profile's health probe on it; only a failed probe evicts it.
A third kind is neither: the trainer's straggler warning (``stragglers_line``), read in every
launch mode (plain, ``--retries``, ``--auto-retry``) where the other two are read only under
``--auto-retry``. It becomes evidence of source ``straggler`` with the rank and the last step of
its window; it blames no host unless the trainer then stops for eviction (class ``straggler``).
Names match by their first label (``x1.hsn.cm`` in a log is host ``x1``); names outside the pool
are ignored. Evidence text is bounded and free of NUL bytes, so its record reads back.
Standard library only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import ipaddress
import math
import re
import signal
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from goodput import stragglers_line
from goodput.errors import ExitCode, GoodputError
from goodput.io import read_json
from goodput.launch.attempt import AttemptResult
from goodput.launch.history import AttemptClass, Evidence
from goodput.launch.launchers import LaunchPlan

# HOST evidence on any machine; a profile's ``bad_node_patterns`` add the site's (their name
# says what they are for: a site lists what its nodes print when they fail).
BAD_NODE_PATTERNS = (
    # srun, per task: "srun: error: nid001234: task 7: Bus error". SIGBUS is the kernel's memory
    # fault handler: the node's memory or a device mapped into it failed.
    r"srun: error: (?P<host>[\w.-]+): tasks? [\d,-]+: Bus error",
    # Slurm lost the node itself.
    r"srun: error: Node failure on (?P<host>[\w.-]+)",
    # MPICH Hydra's two-line block: "=   PID 123 RUNNING AT host" / "=   EXIT CODE: 7" (SIGBUS).
    r"RUNNING AT (?P<host>[\w.-]+)\s*\n=\s+(EXIT CODE|KILLED BY SIGNAL): 7\b",
    # goodput train's last line when a rank fails on a device error: the device is the host's.
    r"goodput: error: rank \d+ on (?P<host>[\w.-]+): .*"
    r"(CUDA error|HIP error|UR_RESULT_ERROR|ECC|device lost|DEVICE_LOST|Xid)",
)
# PEER evidence: a process on the named host went away, which its host may have survived.
PEER_PATTERNS = (
    # gloo, when the process at the other end of a connection ends: its address.
    r"Connection closed by peer \[(?P<addr>[0-9A-Fa-f.:]+)\]",
    r"\[(?P<addr>[0-9A-Fa-f.:]+)\]:\d+: Connection reset by peer",
    # NCCL's socket transport: "Connection closed by remote peer NAME<PORT>" (a name or address).
    r"Connection closed by remote peer (?P<addr>[\w.:-]+)<\d+>",
    # A rank that exited with an error or was killed, as srun and Hydra report it. SIGKILL is
    # the OOM killer's or someone's kill as often as a dying node's, so it too only makes the
    # host a suspect; 15 is the launcher's own teardown of the innocent ranks and names no one.
    r"srun: error: (?P<host>[\w.-]+): tasks? [\d,-]+: (Killed|Exited with exit code [1-9]\d*)",
    r"RUNNING AT (?P<host>[\w.-]+)\s*\n=\s+(EXIT CODE|KILLED BY SIGNAL): (?!(7|15)\b)[1-9]\d*",
)
WINDOW_LINES = 3  # a pattern may span this many consecutive lines (Hydra's block spans two)
# Of each line, only the head is scanned: evidence lines are short, and a pattern's cost on a
# megabyte line without a newline (attempt's longest) could stall the launcher.
SCAN_BYTES = 4096
RESOLVE_TIMEOUT_S = 5.0
HEARTBEAT_BYTES = 1 << 16  # the trainer writes a line of JSON
# Of a probe's output, the last bytes are kept: its verdict is its last line.
PROBE_ANSWER_BYTES = 1 << 16
MAX_STEP = 2**53
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# The trainer warns once per rank and lag; hostile output could name any number of ranks.
MAX_STRAGGLERS = 64


class EvidenceScanner:
    """Fed every output line of an attempt; keeps, for each host of the pool, the first line of
    host evidence against it (``found``) and the first line of peer evidence (``suspected``),
    and the straggler warnings about ranks on pool hosts (``stragglers``: the first per rank and
    window, by (rank, first step), in order, at most ``MAX_STRAGGLERS``). With no patterns it
    reads only the warnings."""

    def __init__(
        self,
        patterns: Iterable[str],
        pool: Sequence[str],
        resolve: Callable[[str], list[str]] | None = None,
        peer_patterns: Iterable[str] = (),
    ) -> None:
        self.patterns = [re.compile(pattern) for pattern in patterns]
        self.peer_patterns = [re.compile(pattern) for pattern in peer_patterns]
        self.by_short_name = {_short(host): host for host in pool}
        self.resolve = resolve if resolve is not None else resolve_address
        self.window: collections.deque[str] = collections.deque(maxlen=WINDOW_LINES)
        self.found: dict[str, Evidence] = {}
        self.suspected: dict[str, Evidence] = {}
        self.stragglers: dict[tuple[int, int], Evidence] = {}
        self.resolved: dict[str, str | None] = {}

    def __call__(self, line: bytes) -> None:
        self.window.append(ANSI.sub("", line[:SCAN_BYTES].decode(errors="replace")))
        self._straggler(self.window[-1])
        if not (self.patterns or self.peer_patterns):
            return
        text = "\n".join(self.window)
        self._scan(self.patterns, text, self.found)
        self._scan(self.peer_patterns, text, self.suspected)

    def _straggler(self, line: str) -> None:
        notice = stragglers_line.parse_notice(line)
        if notice is None or (notice.rank, notice.first_step) in self.stragglers:
            return
        host = self._host(notice.host)
        if host is not None and len(self.stragglers) < MAX_STRAGGLERS:
            said = _printable(notice.line())  # as the trainer wrote it, without any prefix
            self.stragglers[(notice.rank, notice.first_step)] = Evidence(
                host, said, "straggler", rank=notice.rank, step=notice.last_step
            )

    def _scan(self, patterns: list[re.Pattern[str]], text: str, into: dict[str, Evidence]) -> None:
        for pattern in patterns:
            match = pattern.search(text)
            if match is None:
                continue
            groups = match.groupdict()
            host = self._host(groups["host"]) if groups.get("host") else None
            if host is None and groups.get("addr"):
                host = self._host_of_address(groups["addr"])
            if host is not None and host not in into:
                into[host] = Evidence(host, _printable(match.group(0).strip()), "log")

    def _host(self, name: str) -> str | None:
        return self.by_short_name.get(_short(name))

    def _host_of_address(self, addr: str) -> str | None:
        """The pool host an address (or a name, as NCCL may print) belongs to."""
        if not _is_address(addr) and (host := self._host(addr)) is not None:
            return host
        if addr not in self.resolved:  # one lookup per address, however often it is logged
            names = self.resolve(addr)
            self.resolved[addr] = next((h for n in names if (h := self._host(n))), None)
        return self.resolved[addr]


def on_hosts(items: Iterable[Evidence], hosts: Sequence[str]) -> list[Evidence]:
    """The items about ``hosts``, each naming its host as ``hosts`` spells it (a rank names its
    host by the first label, as output lines do); items about other hosts are left out."""
    by_short_name = {_short(host): host for host in hosts}
    return [
        dataclasses.replace(item, host=by_short_name[_short(item.host)])
        for item in items
        if _short(item.host) in by_short_name
    ]


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _short(name: str) -> str:
    return name.split(".", 1)[0].lower()


def _printable(said: str) -> str:
    """Evidence as a record keeps it: bounded, and without NUL bytes (which no record holds)."""
    return said[: WINDOW_LINES * SCAN_BYTES].replace("\0", "\ufffd")


def resolve_address(addr: str) -> list[str]:
    """Host names of an address (reverse DNS, then /etc/hosts aliases); [] when unknown or slow,
    since a DNS outage must not stop the recovery."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(socket.gethostbyaddr, addr)
        try:
            name, aliases, _ = future.result(RESOLVE_TIMEOUT_S)
        except (OSError, concurrent.futures.TimeoutError):
            return []
    return [name, *aliases]


def probe_hosts(
    plan: LaunchPlan, hosts: Sequence[str], env: Mapping[str, str]
) -> dict[str, Evidence]:
    """Run the profile's health probe on every one of ``hosts`` at once (``fanout.reach``:
    one step of the job's launcher, within the profile's ``health_timeout_s``); the hosts that
    failed, each with the last line its probe printed."""
    # Imported here, not with the module: ``python -m goodput.launch.fanout`` (each node's task)
    # would otherwise find its module imported already by ``goodput.launch``.
    from goodput.launch import fanout

    timeout_s = plan.profile.health_timeout_s
    answers = fanout.reach(
        plan,
        hosts,
        plan.profile.health_command(),
        env,
        timeout_s=timeout_s,
        max_bytes=PROBE_ANSWER_BYTES,
        fix="fix health_check in the machine profile",
        tail=True,
        stderr=True,
    )
    failed = {}
    for host, answer in answers.items():
        if answer.code is None:
            said = f"no answer within {timeout_s:g} s"
        else:
            lines = answer.output.decode(errors="replace").strip().splitlines()
            said = _printable(f"exit {answer.code}: {lines[-1] if lines else 'no output'}")
        if answer.code != 0:
            failed[host] = Evidence(host, f"health probe {said}", "probe")
    return failed


def classify(
    result: AttemptResult, steps_gained: int, named: Sequence[Evidence], *, finished: bool = False
) -> AttemptClass:
    """The attempt's class; ``named``: the host evidence against its hosts (peer evidence, hang
    suspects and straggler warnings are no class of their own: the attempt failed for whatever
    its exit says); ``finished``: the trainer's last heartbeat, written in this attempt, said
    the run is complete, so whatever its processes did after that (a teardown that hung past
    the idle watchdog, a crash on exit) it is a success, never retried."""
    code = result.exit_code
    if code == ExitCode.OK or finished:
        return "success"
    if result.launcher_signal == signal.SIGINT or code == ExitCode.INTERRUPTED:
        return "interrupted"
    if result.launcher_signal == signal.SIGTERM or (code == ExitCode.TERMINATED and not named):
        return "walltime"
    if code == ExitCode.STRAGGLER and not result.timed_out:
        return "straggler"  # the trainer's own stop after a save: no host failed
    if named:
        return "bad-node"
    if result.timed_out:
        return "hang"
    if steps_gained == 0:
        return "stuck-pre-training"
    return "error"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """What the trainer's ``heartbeat`` file said: its last step, and when (its clock); ``done``:
    the run's last beat, written once the run is complete (``done`` marker written), at that
    time rather than a step's."""

    step: int
    time: float
    done: bool = False


@dataclass(frozen=True, slots=True)
class Progress:
    steps_gained: int  # steps this attempt ran (a resumed run recomputes some: they count)
    last_step: int | None  # the highest step it reached; None: it reached none


def progress(result: AttemptResult, before: Heartbeat | None, after: Heartbeat | None) -> Progress:
    """How far an attempt got: by its ``step=`` lines, or by the heartbeat file, which the trainer
    rewrites every step wherever its output goes (a wrapper may filter the lines, a launcher may
    label them). A heartbeat that changed during the attempt proves at least one step; the
    steps it moved past the one before are a lower bound (a resumed run starts lower)."""
    by_lines, last_step = 0, result.last_step
    if result.first_step is not None and result.last_step is not None:
        by_lines = result.last_step - result.first_step + 1
    by_heartbeat = 0
    if after is not None and after != before:
        moved = after.step - (before.step if before is not None else 0)
        # The last beat is written at the run's end, not at a step: only its step counts.
        by_heartbeat = max(0, moved) if after.done else max(1, moved)
    if after is not None and by_heartbeat:
        last_step = after.step if last_step is None else max(last_step, after.step)
    return Progress(max(by_lines, by_heartbeat), last_step)


def finished(before: Heartbeat | None, after: Heartbeat | None) -> bool:
    """Whether the trainer wrote its last beat (the run is complete) during the attempt."""
    return after is not None and after.done and after != before


def read_heartbeat(path: Path | None) -> Heartbeat | None:
    """The heartbeat file; None when it is absent, replaced mid-read or not a heartbeat (the run
    folder may be shared: whatever is there is read bounded, strictly)."""
    if path is None:
        return None
    try:
        raw = read_json(path, HEARTBEAT_BYTES)
        step, when = raw["step"], raw["time"]
    except (GoodputError, KeyError, TypeError):
        return None
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        return None
    if type(when) not in (int, float) or not math.isfinite(when):
        return None
    done = raw.get("done", False)
    if type(done) is not bool or not set(raw) <= {"step", "time", "done"}:
        return None
    return Heartbeat(step, float(when), done)


@dataclass
class Pool:
    """The hosts that run ranks (their order is rank order) and the spares behind them."""

    active: list[str]
    spares: list[str]

    def replace(self, bad: Sequence[str]) -> dict[str, str]:
        """Swap each bad active host for the next spare, in place; old -> new."""
        swaps = {}
        for host in bad:
            spare = self.spares.pop(0)
            self.active[self.active.index(host)] = spare
            swaps[host] = spare
        return swaps
