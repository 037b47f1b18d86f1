"""Broadcast a folder (a virtual environment, a checkpoint) to a node-local path on every host.

A star, where the shared filesystem serves every host, costs O(N) copies' time; here every host
that has finished becomes a source, so the copies form a greedy tree and the makespan grows as
O(log N). The policy: the origin (the local ``source`` folder, usually on the shared filesystem)
and each finished host serve at most ``fanout`` copies at once (one NIC saturates at about
eight); each pending host is routed to the least-busy source with a free slot, the origin last
among equals so the shared filesystem is left alone once hosts can serve; a failed copy is
retried, from another source where one is free, up to ``retries`` times, then reported. The
broadcast fails only when fewer than ``min_success`` hosts got a copy. ``simulate`` predicts the
makespan of the same policy and of a star.

Transports (``TRANSPORTS``, keyed by the CLI ``--transport`` kind) carry out one copy:
  - local: host H's node-local path is ``dest`` with ``{host}`` replaced, on this machine (tests,
    and a demonstration of the tree without a cluster);
  - rsync: ``rsync -a --delete`` over ssh, pushed by the source host;
  - tar: ``tar -c | ssh DST tar -x``, run on the source host.
The remote transports pass ``-F SSH_CONFIG`` to every ssh they start, the ssh a source host runs
to reach the next host included, so that file must sit at the same path on every host.
Invariants: a copy lands under a temp sibling and is renamed onto its final path only when
complete, so a half copy never looks like a copy; host names and node-local paths are validated
(letters, digits and a few punctuation marks) before they reach a command line; local commands are
argv lists and every remote argument is ``shlex.quote``d (ssh hands the remote shell one string).
A virtual environment names its own absolute path (in ``bin/activate*``, ``pyvenv.cfg`` and the
shebang lines of ``bin/*``): the local transport rewrites each copy; for the remote ones, which
copy bytes as they are, ``broadcast`` first stages one rewritten copy on this machine and sends
that, so a venv goes to one node-local path on every host. Standard library only; nothing here
imports torch.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from goodput.errors import ExitCode, GoodputError
from goodput.io import DIR_MODE
from goodput.launch.env import check_host

ORIGIN = "(origin)"  # not a valid host name, so it never collides with one
DEFAULT_FANOUT = 8
MAX_THREADS = 512  # copies running at once from this process; the rest wait in the pool's queue
COMMAND_TIMEOUT_S = 3600.0


@dataclass(frozen=True, slots=True)
class Copy:
    source: str  # ORIGIN or the host that served it
    host: str
    start_s: float  # since the broadcast began
    seconds: float


@dataclass(slots=True)
class BroadcastResult:
    succeeded: list[str] = field(default_factory=list)  # in order of completion
    failed: dict[str, str] = field(default_factory=dict)  # host -> the last attempt's reason
    makespan_s: float = 0.0
    copies: list[Copy] = field(default_factory=list)  # successful copies only


class Transport(Protocol):
    # True when ``copy`` points a copied venv at its new path itself; else ``broadcast`` stages.
    rewrites_venv_prefix: bool

    def path(self, host: str) -> str:
        """The node-local path of the copy on ``host``."""
        ...

    def copy(self, origin: Path, src_host: str | None, dst_host: str) -> None:
        """Copy ``origin`` (``src_host`` None) or ``src_host``'s copy to ``dst_host``."""
        ...


def _host_path(dest: str, host: str) -> str:
    return dest.replace("{host}", host)


class LocalTransport:
    """Every "host" is a folder on this machine: ``dest`` with ``{host}`` replaced."""

    rewrites_venv_prefix = True

    def __init__(self, dest: str, ssh_config: Path | None = None) -> None:
        if ssh_config is not None:
            raise GoodputError(
                "--ssh-config",
                "the local transport runs no ssh",
                "drop --ssh-config, or use --transport rsync or tar",
                code=ExitCode.USAGE,
            )
        if "{host}" not in dest:
            raise GoodputError(
                "--dest",
                f"{dest!r} has no {{host}} for the local transport",
                "give each host its own folder, e.g. /tmp/nodes/{host}/venv",
                code=ExitCode.USAGE,
            )
        self.dest = dest

    def path(self, host: str) -> str:
        return os.path.abspath(_host_path(self.dest, host))

    def copy(self, origin: Path, src_host: str | None, dst_host: str) -> None:
        src = origin.absolute() if src_host is None else Path(self.path(src_host))
        dst = Path(self.path(dst_host))
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
        try:
            shutil.copytree(src, tmp, symlinks=True, dirs_exist_ok=True)
            os.chmod(tmp, DIR_MODE)
            fix_venv_prefix(tmp, old=str(src), new=str(dst))
            if dst.exists():
                shutil.rmtree(dst)
            os.replace(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# What may reach a remote command line as a path: absolute, and characters no shell, rsync
# version or ssh config parser treats specially (quoting is kept anyway, as a second guard).
SAFE_PATH = re.compile(r"^/[A-Za-z0-9_.+,=@%/-]*$")


def _check_path(path: str, where: str, given: str) -> None:
    """Refuse ``path``, ``given`` as such by the user, unless SAFE_PATH matches it."""
    # normpath: no "..", "." or "//" parts, and "/" itself is refused since the copy replaces it.
    if not SAFE_PATH.match(path) or os.path.normpath(path) != path or path == "/":
        raise GoodputError(
            where,
            f"{given!r} is not a safe absolute path",
            "use a normalized absolute path of letters, digits and _.+,=@%-, e.g. /tmp/venv",
            code=ExitCode.USAGE,
        )


class _RemoteTransport:
    """Copies between hosts over ssh; ``commands`` is the argv pipelines of one copy, in order."""

    rewrites_venv_prefix = False

    def __init__(self, dest: str, ssh_config: Path | None = None) -> None:
        self.dest = dest
        _check_path(self.path("h"), "--dest", dest)  # valid host names keep a safe path safe
        self.ssh = ["ssh"]
        if ssh_config is not None:
            # Absolute: the source hosts run ssh with it too, from their home folders.
            config = ssh_config.absolute()
            _check_path(str(config), "--ssh-config", str(ssh_config))
            if not config.is_file():
                raise GoodputError(
                    "--ssh-config",
                    f"{ssh_config} is not a file",
                    "give an ssh client config file",
                    code=ExitCode.USAGE,
                )
            self.ssh += ["-F", str(config)]

    def path(self, host: str) -> str:
        return _host_path(self.dest, host)

    def commands(self, origin: Path, src_host: str | None, dst_host: str) -> list[list[list[str]]]:
        raise NotImplementedError

    def copy(self, origin: Path, src_host: str | None, dst_host: str) -> None:
        for host in (src_host, dst_host):
            if host is not None:
                check_host(host, "broadcast")
        for pipeline in self.commands(origin, src_host, dst_host):
            _run_pipeline(pipeline)

    def _on(self, host: str, *argv: str) -> list[str]:
        """Run ``argv`` on ``host``: ssh joins its arguments into one line, so quote each."""
        return [*self.ssh, host, shlex.join(argv)]

    def _publish(self, dst_host: str) -> list[list[str]]:
        """Rename the finished temp copy onto the final path, on ``dst_host``."""
        final = shlex.quote(self.path(dst_host))
        partial = shlex.quote(self.path(dst_host) + ".partial")
        return [[*self.ssh, dst_host, f"rm -rf {final} && mv {partial} {final}"]]


class RsyncTransport(_RemoteTransport):
    def commands(self, origin: Path, src_host: str | None, dst_host: str) -> list[list[list[str]]]:
        partial = self.path(dst_host) + ".partial"
        # rsync makes the last folder only; --rsync-path runs before the receiver on dst_host.
        rsync = ["rsync", "-a", "--delete", "-e", shlex.join(self.ssh)]
        rsync += ["--rsync-path", f"mkdir -p {shlex.quote(partial)} && rsync"]
        target = f"{dst_host}:{partial}/"
        if src_host is None:
            push = [*rsync, f"{origin.absolute()}/", target]
        else:  # the source host pushes, so the bytes never pass through this machine
            push = self._on(src_host, *rsync, f"{self.path(src_host)}/", target)
        return [[push], self._publish(dst_host)]


class TarTransport(_RemoteTransport):
    def commands(self, origin: Path, src_host: str | None, dst_host: str) -> list[list[list[str]]]:
        partial = shlex.quote(self.path(dst_host) + ".partial")
        # A stale partial from a failed try would mix with this one: start empty.
        unpack = f"rm -rf {partial} && mkdir -p {partial} && tar -C {partial} -xf -"
        receive = [*self.ssh, dst_host, unpack]
        if src_host is None:
            stream = [["tar", "-C", str(origin.absolute()), "-cf", "-", "."], receive]
        else:
            # pipefail: tar -c skips a file it cannot read and only its exit status says so; the
            # copy must fail, not be published without it. bash: the user's shell may be any.
            pack = shlex.join(["tar", "-C", self.path(src_host), "-cf", "-", "."])
            line = f"{pack} | {shlex.join(receive)}"
            stream = [self._on(src_host, "bash", "-o", "pipefail", "-c", line)]
        return [stream, self._publish(dst_host)]


TRANSPORTS: dict[str, Callable[[str, Path | None], Transport]] = {
    "local": LocalTransport,
    "rsync": RsyncTransport,
    "tar": TarTransport,
}


def make_transport(kind: str, dest: str, ssh_config: Path | None = None) -> Transport:
    if kind not in TRANSPORTS:
        raise GoodputError(
            "--transport",
            f"unknown transport {kind!r}",
            f"use one of {', '.join(TRANSPORTS)}",
            code=ExitCode.USAGE,
        )
    return TRANSPORTS[kind](dest, ssh_config)


def _run_pipeline(argvs: Sequence[list[str]]) -> None:
    """Run argv lists connected stdout to stdin; raise with every failed stage's stderr.

    Every stage is waited for: when one end of a pipe fails the other usually fails too (a broken
    pipe), and only both messages together say which was the cause. Stderr goes to files, not
    pipes, so a chatty stage cannot block while another one is waited for.
    """
    failures = []
    with contextlib.ExitStack() as stack:
        stages = []
        reader: IO[bytes] | None = None  # the previous stage's stdout
        for i, argv in enumerate(argvs):
            err = stack.enter_context(tempfile.TemporaryFile())
            proc = subprocess.Popen(
                argv,
                # DEVNULL, not our stdin: ssh would read it (a terminal, a test runner's).
                stdin=subprocess.DEVNULL if reader is None else reader,
                stdout=subprocess.PIPE if i < len(argvs) - 1 else subprocess.DEVNULL,
                stderr=err,
            )
            stack.callback(_kill, proc)  # on any way out; a no-op for a stage that ended
            if reader is not None:
                reader.close()  # the reader's copy only, so a writer sees it die (SIGPIPE)
            reader = proc.stdout
            if reader is not None:
                stack.callback(reader.close)
            stages.append((argv, proc, err))
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        for argv, proc, err in stages:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                err.seek(0)
                # The head: the cause comes first (ssh's, before rsync's "connection closed").
                message = " ".join(err.read().decode(errors="replace").split())[:200]
                failures.append(
                    f"{argv[0]} exited {proc.returncode}" + (f": {message}" if message else "")
                )
    if failures:
        raise RuntimeError("; ".join(failures))


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def is_venv(folder: Path) -> bool:
    return (folder / "pyvenv.cfg").is_file() and (folder / "bin" / "activate").is_file()


def fix_venv_prefix(folder: Path, *, old: str, new: str) -> int:
    """Point a copied venv at its new home: ``bin/activate*``, ``pyvenv.cfg`` (its ``command``
    line) and the shebangs of ``bin/*``.

    Returns the number of files rewritten; a folder that is not a venv is left alone.
    """
    if old == new or not is_venv(folder):
        return 0
    old_b, new_b = old.encode(), new.encode()
    # A whole path only: /a/venv must not match inside /a/venv2.
    pattern = re.compile(re.escape(old_b) + rb"(?![A-Za-z0-9._-])")
    num_rewritten = 0
    for path in [folder / "pyvenv.cfg", *sorted((folder / "bin").iterdir())]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if path.name.startswith("activate") or path.name == "pyvenv.cfg":
            fixed = pattern.sub(new_b, data)
        elif data.startswith(b"#!"):
            first, sep, rest = data.partition(b"\n")
            fixed = pattern.sub(new_b, first) + sep + rest
        else:
            continue
        if fixed != data:
            mode = path.stat().st_mode
            path.write_bytes(fixed)
            os.chmod(path, mode)
            num_rewritten += 1
    return num_rewritten


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


def _check_args(
    source: Path, hosts: Sequence[str], fanout: int, retries: int, min_success: int | None
) -> int:
    if not source.is_dir():
        raise GoodputError(
            "broadcast", f"{source} is not a folder", "give the folder to copy", code=ExitCode.USAGE
        )
    if fanout < 1 or retries < 0:
        raise GoodputError(
            "broadcast",
            f"fanout {fanout}, retries {retries}",
            "use a fanout of at least 1 and retries of at least 0",
            code=ExitCode.USAGE,
        )
    for host in hosts:
        check_host(host, "--hosts")
    if len(set(hosts)) != len(hosts):
        raise GoodputError(
            "--hosts", "a host is listed twice", "list each host once", code=ExitCode.USAGE
        )
    needed = len(hosts) if min_success is None else min_success
    if not 0 <= needed <= len(hosts):
        raise GoodputError(
            "--min-success",
            f"{needed} of {len(hosts)} hosts",
            f"use a number from 0 to {len(hosts)}",
            code=ExitCode.USAGE,
        )
    return needed


@contextlib.contextmanager
def _origin(source: Path, hosts: Sequence[str], transport: Transport) -> Iterator[Path]:
    """The folder the origin serves: ``source``, or a staged copy of a venv pointed at its
    destination when the transport copies bytes as they are (removed afterwards)."""
    old = str(source.absolute())
    paths = {transport.path(host) for host in hosts}
    if transport.rewrites_venv_prefix or not is_venv(source) or paths <= {old}:
        yield source
        return
    if len(paths) > 1:  # one staged copy has one prefix, and hosts copy it on as it is
        raise GoodputError(
            "--dest",
            f"a venv must go to one path on every host, not {len(paths)} ({{host}} in --dest)",
            "drop {host} from --dest, or use the local transport",
            code=ExitCode.USAGE,
        )
    stage = Path(tempfile.mkdtemp(prefix="goodput-broadcast-"))
    try:
        staged = stage / source.name
        shutil.copytree(source, staged, symlinks=True)
        fix_venv_prefix(staged, old=old, new=paths.pop())
        yield staged
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def broadcast(
    source: Path,
    hosts: Sequence[str],
    *,
    transport: Transport,
    fanout: int = DEFAULT_FANOUT,
    retries: int = 2,
    min_success: int | None = None,
    relay: bool = True,
    progress: Callable[[str], None] = print,
) -> BroadcastResult:
    """Copy ``source`` to ``transport.path(host)`` on every host by the greedy tree.

    ``min_success`` None means every host. ``relay=False`` is the star: only the origin serves.
    Raises ``GoodputError`` naming the failed hosts when fewer than ``min_success`` succeeded.
    """
    needed = _check_args(source, hosts, fanout, retries, min_success)
    result = BroadcastResult()
    busy: dict[str, int] = {ORIGIN: 0}  # in insertion order: the origin, then hosts as they finish
    order = {ORIGIN: 0}
    pending = deque(hosts)
    num_failures: dict[str, int] = {}
    last_failed_source: dict[str, str] = {}
    in_flight: dict[Future[tuple[float, float]], tuple[str, str]] = {}
    began = time.monotonic()

    def timed_copy(src: str, host: str) -> tuple[float, float]:
        start = time.monotonic()
        transport.copy(origin, None if src == ORIGIN else src, host)
        return start - began, time.monotonic() - start

    def pick_source(host: str) -> str | None:
        free = [src for src, num_busy in busy.items() if num_busy < fanout]
        if not free:
            return None
        return min(
            free,
            key=lambda src: (
                src == last_failed_source.get(host),  # a retry goes elsewhere when it can
                busy[src],
                src == ORIGIN,  # spare the shared filesystem once hosts serve
                order[src],
            ),
        )

    with (
        _origin(source, hosts, transport) as origin,
        ThreadPoolExecutor(max_workers=max(1, min(len(hosts), MAX_THREADS))) as pool,
    ):
        while pending or in_flight:
            while pending and (src := pick_source(pending[0])) is not None:
                host = pending.popleft()
                busy[src] += 1
                in_flight[pool.submit(timed_copy, src, host)] = (src, host)
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                src, host = in_flight.pop(future)
                busy[src] -= 1
                error = future.exception()
                if error is None:
                    start_s, seconds = future.result()
                    result.copies.append(Copy(src, host, start_s, seconds))
                    result.succeeded.append(host)
                    if relay:
                        busy[host] = 0
                        order[host] = len(order)
                    continue
                reason = _one_line(error)
                num_failures[host] = num_failures.get(host, 0) + 1
                last_failed_source[host] = src
                if num_failures[host] <= retries:
                    progress(f"broadcast: {host} from {src} failed ({reason}); retrying")
                    pending.append(host)
                else:
                    progress(f"broadcast: {host} failed {num_failures[host]} times: {reason}")
                    result.failed[host] = reason
    result.makespan_s = time.monotonic() - began
    if len(result.succeeded) < needed:
        listed = [f"{host} ({reason})" for host, reason in list(result.failed.items())[:10]]
        more = len(result.failed) - len(listed)
        raise GoodputError(
            "broadcast",
            f"{len(result.succeeded)} of {len(hosts)} hosts got a copy, {needed} needed; "
            f"failed: {', '.join(listed)}" + (f" and {more} more" if more > 0 else ""),
            "fix or drop the failed hosts, or lower --min-success",
        )
    return result


def simulate(num_hosts: int, copy_seconds: float, fanout: int) -> tuple[float, float]:
    """Predicted makespans (tree, star) of ``num_hosts`` copies of ``copy_seconds`` each.

    Tree: the greedy policy above, as an event simulation over the times slots come free (every
    copy takes as long, so the earliest free slot is the least-busy source). Star: the origin
    alone, ``fanout`` at a time: ceil(N / fanout) rounds.
    """
    if num_hosts < 0 or copy_seconds < 0 or fanout < 1:
        raise GoodputError(
            "broadcast --simulate",
            f"nodes {num_hosts}, copy seconds {copy_seconds}, fanout {fanout}",
            "use nodes >= 0, copy seconds >= 0 and a fanout of at least 1",
            code=ExitCode.USAGE,
        )
    free_at = [0.0] * fanout  # the origin's slots
    makespan = 0.0
    for _ in range(num_hosts):
        start = heapq.heappop(free_at)
        finish = start + copy_seconds
        makespan = max(makespan, finish)
        heapq.heappush(free_at, finish)  # the source's slot comes free again
        for _ in range(fanout):  # and the finished host serves from now on
            heapq.heappush(free_at, finish)
    return makespan, math.ceil(num_hosts / fanout) * copy_seconds


def read_hosts(hosts: str | None, hostfile: Path | None) -> list[str]:
    """Hosts from a comma list or a host file (one a line, '#' comments; repeats dropped)."""
    if (hosts is None) == (hostfile is None):
        raise GoodputError(
            "broadcast",
            "need exactly one of --hosts and --hostfile",
            "give --hosts h1,h2,... or --hostfile FILE",
            code=ExitCode.USAGE,
        )
    if hostfile is not None:
        names = [line.split("#")[0].strip() for line in hostfile.read_text().splitlines()]
    else:
        names = [name.strip() for name in (hosts or "").split(",")]
    # A PBS node file names a host once per rank; the copy is per host.
    return list(dict.fromkeys(name for name in names if name))
