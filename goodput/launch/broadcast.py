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

Transports (``transports``) carry out one copy: local, rsync or tar over ssh.
Invariants: a copy lands under a temp sibling and is renamed onto its final path only when
complete, so a half copy never looks like a copy; each finished copy carries the transport's
marker file naming its source, and only a copy with that marker is ever replaced, so a
``--dest`` that names someone's folder is refused, never emptied; a destination may not lie
inside the source or hold it. Host names and node-local paths are validated (letters, digits and
a few punctuation marks; absolute and normalized) before they reach a command line; local
commands are argv lists and every remote argument is ``shlex.quote``d (ssh hands the remote shell
one string). A copy refused that way is not retried: the next try would find the same folder.
Links are copied as links, and nothing written into a copy after it is made (the prefix, the
staged files, the marker) goes through one (``io.write_inside``); a venv whose files a copy must
rewrite lie behind a link (``bin/`` a link to a folder elsewhere) is refused before any copy,
naming the link (``transports.check_venv_links``, ``layers.plan_layers``).
A virtual environment names its own absolute path (in ``bin/activate*``, ``pyvenv.cfg`` and the
shebang lines of ``bin/*``): the local transport rewrites each copy; for the remote ones, which
copy bytes as they are, ``broadcast`` first makes one prepared copy (rewritten) on this machine
and sends that, so a venv goes to one node-local path on every host. A venv that imports from
outside itself (system site-packages, ``.pth`` folders) is staged with those folders
(``layers``): the prepared copy holds them, so the copies import from their own disk. With the
archive transport (``--compress``), the origin serves one tar.zst file instead
(``archive.write_archive``: the source read once, in one pass, into ``$TMPDIR``), which the
hosts forward as it is and drop when the broadcast is over. Hosts done are shown as
they finish (``goodput.progress``: a bar on a terminal, periodic lines on stderr otherwise).
Standard library only, and rich for that bar; nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import os
import shutil
import socket
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from goodput.errors import GoodputError
from goodput.io import first_link, json_text, link_in_the_way, special_entries, write_inside
from goodput.launch.archive import ArchiveStats, require_zstd, write_archive
from goodput.launch.env import MAX_HOSTS, check_host, read_hostfile
from goodput.launch.layers import LAYERS_DIR, VenvLayers, plan_layers
from goodput.launch.transports import (
    ArchiveTransport,
    Transport,
    check_venv_links,
    fix_venv_prefix,
    is_venv,
)
from goodput.progress import Progress

ORIGIN = "(origin)"  # not a valid host name, so it never collides with one
DEFAULT_FANOUT = 8
MAX_THREADS = 512  # copies running at once from this process; the rest wait in the pool's queue


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
    archive: ArchiveStats | None = None  # --compress: the one archive, and the source read


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]


def _check_args(
    source: Path,
    hosts: Sequence[str],
    transport: Transport,
    fanout: int,
    retries: int,
    min_success: int | None,
) -> int:
    if not source.is_dir():
        raise GoodputError.usage(
            "broadcast", f"{source} is not a folder", "give the folder to copy"
        )
    if fanout < 1 or retries < 0:
        raise GoodputError.usage(
            "broadcast",
            f"fanout {fanout}, retries {retries}",
            "use a fanout of at least 1 and retries of at least 0",
        )
    for host in hosts:
        check_host(host, "--hosts")
    if len(set(hosts)) != len(hosts):
        raise GoodputError.usage("--hosts", "a host is listed twice", "list each host once")
    needed = len(hosts) if min_success is None else min_success
    if not 0 <= needed <= len(hosts):
        raise GoodputError.usage(
            "--min-success",
            f"{needed} of {len(hosts)} hosts",
            f"use a number from 0 to {len(hosts)}",
        )
    _check_outside(source, {transport.path(host) for host in hosts})
    return needed


def _check_outside(source: Path, paths: set[str]) -> None:
    """Refuse a destination inside the source or holding it: the copy would copy itself, or
    replacing it would take the source along (on a shared filesystem, for the remote ones)."""
    real = PurePosixPath(os.path.realpath(source))
    for path in sorted(paths):
        dest = PurePosixPath(os.path.realpath(path))
        if dest != real and (dest.is_relative_to(real) or real.is_relative_to(dest)):
            raise GoodputError.usage(
                "--dest",
                f"{path} is inside {source} or holds it",
                "copy to a folder beside the source, not within or above it",
            )


@contextlib.contextmanager
def _origin(
    source: Path,
    hosts: Sequence[str],
    transport: Transport,
    staging: VenvLayers | None,
    result: BroadcastResult,
) -> Iterator[Path]:
    """What the origin serves: ``source`` itself; or, in a scratch folder under ``$TMPDIR``
    (removed afterwards), the one archive ``--compress`` sends, or a prepared copy of a venv
    (its layers added, and pointed at its destination when the transport copies bytes as they
    are). Either is made by reading the source once."""
    old = str(source.absolute())
    paths = {transport.path(host) for host in hosts}
    layered = staging is not None and bool(staging.layers or staging.replaced)
    archived = isinstance(transport, ArchiveTransport)
    venv = is_venv(source)
    needs_prefix = venv and not transport.rewrites_venv_prefix and not paths <= {old}
    if not (archived or layered or needs_prefix):
        yield source
        return
    if venv and not transport.rewrites_venv_prefix and len(paths) > 1:
        # One prepared copy has one prefix, and hosts copy it on as it is.
        raise GoodputError.usage(
            "--dest",
            f"a venv must go to one path on every host, not {len(paths)} ({{host}} in --dest)",
            "drop {host} from --dest, or use the local transport",
        )
    if archived:
        require_zstd()
    scratch = Path(tempfile.mkdtemp(prefix="goodput-broadcast-"))
    try:
        new = str(scratch / source.name) if transport.rewrites_venv_prefix else paths.pop()
        prefix = (old, new) if venv and new != old else None
        if archived:
            archive = scratch / f"{source.name}.tar.zst"
            result.archive = write_archive(source, archive, staging=staging, prefix=prefix)
            yield archive
        else:
            yield _prepared_copy(source, scratch / source.name, staging, prefix)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _prepared_copy(
    source: Path, prepared: Path, staging: VenvLayers | None, prefix: tuple[str, str] | None
) -> Path:
    """``source`` copied to ``prepared`` with its layers, replaced files and new prefix."""
    shutil.copytree(source, prepared, symlinks=True, ignore=special_entries)
    if staging is not None:
        # The plan refused links where these writes land; the copy is checked again, since the
        # source may have changed since (``write_inside`` never follows one either).
        if staging.layers and (link := first_link(prepared, LAYERS_DIR)) is not None:
            raise link_in_the_way(link, f"the staged {LAYERS_DIR}/")
        for layer in staging.layers:
            shutil.copytree(
                layer.source,
                prepared / LAYERS_DIR / layer.name,
                symlinks=True,
                ignore=special_entries,
            )
        for name, data in staging.replaced.items():
            write_inside(prepared, name, data)  # a link there is replaced, not written through
    if prefix is not None:
        fix_venv_prefix(prepared, old=prefix[0], new=prefix[1])
    return prepared


def _remove_archives(
    transport: ArchiveTransport, hosts: Sequence[str], progress: Callable[[str], None]
) -> None:
    """Drop each host's copy of the archive, now that no host serves another."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(hosts), MAX_THREADS))) as pool:
        futures = {pool.submit(transport.remove_archive, host): host for host in hosts}
        for future, host in futures.items():
            if (error := future.exception()) is not None:
                path = transport.archive_path(host)
                progress(f"broadcast: {host}: {path} not removed ({_one_line(error)})")


def _staging(source: Path, progress: Callable[[str], None]) -> VenvLayers | None:
    """A venv's layers (``layers.plan_layers``), its notes shown; None for another folder."""
    if not is_venv(source):
        return None
    check_venv_links(source, str(source.absolute()))
    staging = plan_layers(source)
    for layer in staging.layers:
        progress(f"broadcast: staging {layer.source} ({layer.why}) in the copy")
    for note in staging.notes:
        progress(f"broadcast: note: {note}")
    return staging


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
    needed = _check_args(source, hosts, transport, fanout, retries, min_success)
    staging = _staging(source, progress)
    # What each copy's marker file says it is a copy of.
    marker = json_text(
        {"source": os.path.realpath(source), "from": socket.gethostname()},
        where="the broadcast marker",
    )
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
        transport.copy(origin, None if src == ORIGIN else src, host, marker)
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
        _origin(source, hosts, transport, staging, result) as origin,
        ThreadPoolExecutor(max_workers=max(1, min(len(hosts), MAX_THREADS))) as pool,
        Progress("broadcast", total=len(hosts), unit="hosts") as hosts_done,
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
                    hosts_done.advance(1)
                    if relay:
                        busy[host] = 0
                        order[host] = len(order)
                    continue
                reason = _one_line(error)
                num_failures[host] = num_failures.get(host, 0) + 1
                last_failed_source[host] = src
                if num_failures[host] <= retries and not isinstance(error, GoodputError):
                    progress(f"broadcast: {host} from {src} failed ({reason}); retrying")
                    pending.append(host)
                else:
                    progress(f"broadcast: {host} failed {num_failures[host]} times: {reason}")
                    result.failed[host] = reason
        if isinstance(transport, ArchiveTransport):
            _remove_archives(transport, result.succeeded, progress)
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
        raise GoodputError.usage(
            "broadcast --simulate",
            f"nodes {num_hosts}, copy seconds {copy_seconds}, fanout {fanout}",
            "use nodes >= 0, copy seconds >= 0 and a fanout of at least 1",
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
    """Hosts from a comma list or a host file (``env.read_hostfile``: one a line, '#' comments);
    repeats dropped, since a PBS node file names a host once per rank and the copy is per host."""
    if (hosts is None) == (hostfile is None):
        raise GoodputError.usage(
            "broadcast",
            "need exactly one of --hosts and --hostfile",
            "give --hosts h1,h2,... or --hostfile FILE",
        )
    if hostfile is not None:
        found = read_hostfile(hostfile)
    else:
        # Spaces after commas are usual; any other white space (a newline) is refused in a name.
        names = dict.fromkeys(name.strip(" ") for name in (hosts or "").split(","))
        names.pop("", None)
        if len(names) > MAX_HOSTS:
            raise GoodputError.usage(
                "--hosts", f"names more than {MAX_HOSTS:,} hosts", "pass at most that many"
            )
        for name in names:
            check_host(name, "--hosts")
        found = list(names)
    if not found:
        raise GoodputError.usage(
            hostfile or "--hosts", "names no host", "give the hosts to copy to"
        )
    return found
