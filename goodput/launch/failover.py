"""Why an attempt failed and which hosts to blame (``goodput launch --auto-retry``): the attempt
loop (``retry``) asks this module for each attempt's class, its steps gained and the evidence
against hosts, and swaps the blamed hosts for spares with ``Pool``.

Each attempt gets one class, from its exit code, the trainer's progress (``step=N`` lines and the
``heartbeat`` file: steps gained this attempt) and its output:
  - ``success``: exit 0;
  - ``interrupted``: Ctrl-C (130);
  - ``walltime``: 143, the allocation is ending (the launcher itself got SIGTERM, or the ranks
    did with no bad-node evidence);
  - ``bad-node``: an output line names a host (``BAD_NODE_PATTERNS`` plus the profile's own): a
    rank killed by SIGKILL/SIGBUS on host X, a peer closing the connection from an address that
    resolves to X, ...;
  - ``hang``: the idle watchdog fired (124);
  - ``stuck-pre-training``: no step this attempt;
  - ``error``: any other failure.
When no line named a culprit, ``probe_hosts`` runs the profile's health probe on every active
host (in parallel, bounded by its timeout): only hosts that fail it are blamed, never a blind
pick. Evidence text is bounded and free of NUL bytes, so its record reads back.
Patterns are data; the code here only applies them. Standard library only.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from goodput.errors import ExitCode, GoodputError
from goodput.io import read_json
from goodput.launch.attempt import AttemptResult, ProcessSpec, start_process
from goodput.launch.history import AttemptClass, Evidence

# Lines that name a bad host on any machine; a profile's ``bad_node_patterns`` add the site's.
# Signals 9 and 7 are the node's doing (the OOM killer, a dying node, a memory fault); a rank
# ending by SIGTERM is the launcher's own teardown of the innocent ranks, so it names no one.
BAD_NODE_PATTERNS = (
    # Slurm's srun, per task: "srun: error: nid001234: task 7: Killed".
    r"srun: error: (?P<host>[\w.-]+): tasks? [\d,-]+: (Killed|Bus error)",
    r"srun: error: Node failure on (?P<host>[\w.-]+)",
    # MPICH Hydra's two-line block: "=   PID 123 RUNNING AT host" / "=   EXIT CODE: 9".
    r"RUNNING AT (?P<host>[\w.-]+)\s*\n=\s+(EXIT CODE|KILLED BY SIGNAL): (9|7)\b",
    # gloo, when a peer process or its host dies: the peer's address names the host.
    r"Connection closed by peer \[(?P<addr>[0-9A-Fa-f.:]+)\]",
    # goodput train's last line when a rank fails on a device error.
    r"goodput: error: rank \d+ on (?P<host>[\w.-]+): .*"
    r"(CUDA error|HIP error|UR_RESULT_ERROR|ECC|device lost|DEVICE_LOST|Xid)",
)
WINDOW_LINES = 3  # a pattern may span this many consecutive lines (Hydra's block spans two)
# Of each line, only the head is scanned: evidence lines are short, and a pattern's cost on a
# megabyte line without a newline (attempt's longest) could stall the launcher.
SCAN_BYTES = 4096
RESOLVE_TIMEOUT_S = 5.0
HEARTBEAT_BYTES = 1 << 16  # the trainer writes a line of JSON
MAX_STEP = 2**53
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class EvidenceScanner:
    """Fed every output line of an attempt; keeps the first line that names each host of the
    pool. Names are matched by their first label, so ``x1.hsn.cm`` in a log is host ``x1``."""

    def __init__(
        self,
        patterns: Iterable[str],
        pool: Sequence[str],
        resolve: Callable[[str], list[str]] | None = None,
    ) -> None:
        self.patterns = [re.compile(pattern) for pattern in patterns]
        self.by_short_name = {_short(host): host for host in pool}
        self.resolve = resolve if resolve is not None else resolve_address
        self.window: collections.deque[str] = collections.deque(maxlen=WINDOW_LINES)
        self.found: dict[str, Evidence] = {}
        self.resolved: dict[str, str | None] = {}

    def __call__(self, line: bytes) -> None:
        self.window.append(ANSI.sub("", line[:SCAN_BYTES].decode(errors="replace")))
        text = "\n".join(self.window)
        for pattern in self.patterns:
            match = pattern.search(text)
            if match is None:
                continue
            groups = match.groupdict()
            host = self._host(groups["host"]) if groups.get("host") else None
            if host is None and groups.get("addr"):
                host = self._host_of_address(groups["addr"])
            if host is not None and host not in self.found:
                self.found[host] = Evidence(host, _printable(match.group(0).strip()), "log")

    def _host(self, name: str) -> str | None:
        return self.by_short_name.get(_short(name))

    def _host_of_address(self, addr: str) -> str | None:
        if addr not in self.resolved:  # one lookup per address, however often it is logged
            names = self.resolve(addr)
            self.resolved[addr] = next((h for n in names if (h := self._host(n))), None)
        return self.resolved[addr]


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


def probe_hosts(probes: dict[str, ProcessSpec], timeout_s: float) -> dict[str, Evidence]:
    """Run every host's probe at once; the hosts that failed, each with what its probe said."""
    started = {
        host: start_process(spec, "fix health_check in the machine profile")
        for host, spec in probes.items()
    }
    deadline = time.monotonic() + timeout_s
    failed = {}
    for host, process in started.items():
        try:
            output, _ = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            lines = output.decode(errors="replace").strip().splitlines()
            said = f"exit {process.returncode}: {lines[-1] if lines else 'no output'}"
            said = _printable(said)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            said = f"no answer within {timeout_s:g} s"
        if process.returncode != 0:
            failed[host] = Evidence(host, f"health probe {said}", "probe")
    return failed


def classify(result: AttemptResult, steps_gained: int, named: Sequence[Evidence]) -> AttemptClass:
    code = result.exit_code
    if code == ExitCode.OK:
        return "success"
    if result.launcher_signal == signal.SIGINT or code == ExitCode.INTERRUPTED:
        return "interrupted"
    if result.launcher_signal == signal.SIGTERM or (code == ExitCode.TERMINATED and not named):
        return "walltime"
    if named:
        return "bad-node"
    if result.timed_out:
        return "hang"
    if steps_gained == 0:
        return "stuck-pre-training"
    return "error"


def steps_gained(
    result: AttemptResult, heartbeat_before: int | None, heartbeat: Path | None
) -> int:
    """Steps this attempt made: from its ``step=`` lines, or the heartbeat file's step advancing
    (which also counts when the step lines were filtered or went elsewhere)."""
    by_lines = 0
    if result.first_step is not None and result.last_step is not None:
        by_lines = result.last_step - result.first_step + 1
    after = read_heartbeat_step(heartbeat)
    by_heartbeat = after - (heartbeat_before or 0) if after is not None else 0
    return max(by_lines, by_heartbeat)


def read_heartbeat_step(path: Path | None) -> int | None:
    """The step the heartbeat file names; None when it is absent, replaced mid-read or not a
    heartbeat (the run folder may be shared: whatever is there is read bounded, strictly)."""
    if path is None:
        return None
    try:
        step = read_json(path, HEARTBEAT_BYTES)["step"]
    except (GoodputError, KeyError, TypeError):
        return None
    return step if type(step) is int and 0 <= step <= MAX_STEP else None


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
