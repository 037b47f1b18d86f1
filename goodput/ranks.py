"""The launcher <-> rank contract: every ``GOODPUT_*`` variable a rank reads, and the one rule of
which host a rank runs on.

Each name is defined here once, for the side that sets it and the side that reads it:

- ``GOODPUT_HOSTFILE`` (``HOSTFILE_VAR``): the absolute path of the attempt's host file, its
  hosts in rank order, one a line (``launch.launchers.write_hostfile``, the file srun's
  ``--nodelist`` and mpiexec's ``-hostfile`` read too); set by ``goodput launch`` with
  ``LOCAL_WORLD_SIZE``, the ranks a host (torchrun's name; a torchrun under the launcher sets its
  own). A path, not the names: at 10,624 hosts the names are past what one variable or argument
  may hold (Linux's 128 KiB, ``MAX_ARG_STRLEN``), and exec fails. Read once per process
  (``launch_hosts``), strictly: ``rank_host`` and ``every_rank_host`` name each rank's host from
  it, with no collective.
- ``GOODPUT_HEARTBEAT`` (``HEARTBEAT_VAR``): the launcher's heartbeat file, which rank 0 keeps
  too (``rundir.heartbeat_files``).
- ``GOODPUT_BEACON_DIR`` (``BEACON_DIR_VAR``): the attempt's folder of beacon files
  (``beacon.open_beacon``).
- ``GOODPUT_EVICT_STRAGGLERS`` (``EVICT_VAR``): ``1`` from ``goodput launch --evict-stragglers``
  while a spare host is left: a rank named a straggler stops after the next periodic save
  (exit 4) and its host is replaced (``train.monitor.stragglers``).
- ``GOODPUT_PROBE_HOST`` (``PROBE_HOST_VAR``): the host a health probe or a forensics command
  was sent to, as the launcher names it (``launch.health``).
- ``GOODPUT_FAULTS`` (``FAULTS_VAR``): the fault plan ``goodput chaos`` hands a run
  (``faults.load_plan``).
- ``GOODPUT_DEVICE`` (``DEVICE_VAR``): the user's device type, over the probe (``train.device``).
- ``GOODPUT_RECOVERY_STORE`` (``RECOVERY_STORE_VAR``): ``HOST:PORT`` of the recovery store that
  ``goodput launch --in-process`` hosts (``train.recovery``, ``launch.inprocess``);
  ``GOODPUT_SPARE`` (``SPARE_VAR``): set on a warm spare, its number (``parse_spare_id``).

The launcher's own variables (``GOODPUT_PROFILE``, a job chain's ``GOODPUT_CHAIN_*``) are read
by the launcher alone and stay in ``launch``.

Where a rank runs (``host_index``): ranks fill the hosts in order, ``ranks_per_host`` to each,
as srun's block distribution over ``--nodelist``, mpiexec over the host file and the local launch
place them. The launcher's hang forensics, each rank's own host name (beacons, straggler lines,
snapshot partners, injected device errors) and ``goodput chaos`` all use that rule.

Standard library and the root leaves ``goodput.errors`` and ``goodput.io`` only (the bounded
reader and the one-line error): the launcher, the trainer, the checkpoint's snapshots and the
fault hooks all read it.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import socket
from collections.abc import Mapping, Sequence

from goodput.errors import GoodputError
from goodput.io import read_text

HOSTFILE_VAR = "GOODPUT_HOSTFILE"
LOCAL_WORLD_SIZE_VAR = "LOCAL_WORLD_SIZE"  # torchrun's: the ranks a host
HEARTBEAT_VAR = "GOODPUT_HEARTBEAT"
BEACON_DIR_VAR = "GOODPUT_BEACON_DIR"
EVICT_VAR = "GOODPUT_EVICT_STRAGGLERS"
PROBE_HOST_VAR = "GOODPUT_PROBE_HOST"
FAULTS_VAR = "GOODPUT_FAULTS"
DEVICE_VAR = "GOODPUT_DEVICE"
RECOVERY_STORE_VAR = "GOODPUT_RECOVERY_STORE"
SPARE_VAR = "GOODPUT_SPARE"
MAX_SPARES = 1 << 20  # spare numbers a launch hands out: one a spare, a new one each recovery

HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")  # always fullmatch: no "\n" after
MAX_HOST_CHARS = 253
# Ten times the largest machine (Aurora: 10,624 nodes). Above it a node list or host file is a
# mistake or an attack; it is refused after counting, before a list of that size exists.
MAX_HOSTS = 100_000
# The attempt's host file at its largest: every host a whole name and its newline (25 MB).
MAX_LAUNCH_HOSTS_BYTES = MAX_HOSTS * (MAX_HOST_CHARS + 1)
COUNT = re.compile(r"[0-9]{1,9}")
# A rank cannot fix a host file the launcher wrote: the launch, or the folder it wrote it in, is
# what is wrong.
HOSTFILE_FIX = (
    "start the ranks with goodput launch, whose --run-dir every host must see (a shared "
    "filesystem), and leave its files alone while it runs"
)


def host_index(rank: int, ranks_per_host: int) -> int:
    """The index, in the attempt's hosts, of the host rank ``rank`` runs on."""
    return rank // ranks_per_host


def short_name(host: str) -> str:
    """``host`` cut at its first dot: the spelling of a host in every line a rank writes."""
    return host.split(".")[0]


def this_host() -> str:
    """This machine's short name: a rank's host when goodput did not launch it."""
    return short_name(socket.gethostname())


def launcher_host(rank: int, hosts: Sequence[str], ranks_per_host: int) -> str:
    """Rank ``rank``'s host, short, among the attempt's ``hosts`` with ``ranks_per_host`` ranks
    to a host (the launcher's view of what the rank itself prints); this machine's short name
    when they do not name it."""
    index = host_index(rank, ranks_per_host) if ranks_per_host > 0 else len(hosts)
    return short_name(hosts[index]) if index < len(hosts) else this_host()


def launch_hosts(environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """The attempt's hosts in rank order, as ``goodput launch`` wrote them (``HOSTFILE_VAR``),
    read once per process; None when goodput did not launch this process. A file that cannot be
    read, or is no host file the launcher wrote, is one line naming it."""
    path = environ.get(HOSTFILE_VAR)
    return None if path is None else _short_hosts(path)[0]


def rank_host(rank: int, environ: Mapping[str, str]) -> str:
    """This rank's host as ``goodput launch`` named it (its emulated hosts too), short, else this
    machine's name: the one spelling of a rank's host in beacons, straggler lines, snapshot
    partners and injected device errors."""
    found = _launched(rank + 1, environ)
    return this_host() if found is None else found[host_index(rank, _ranks_per_host(environ))]


def every_rank_host(world_size: int, environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """Every rank's host, by rank (``rank_host`` of each), with no collective, when goodput
    launched the ranks; else None. The names are the host file's, shared: at 127,488 ranks on
    10,624 hosts, 10,624 strings and one tuple of references (1 MB)."""
    found = _launched(world_size, environ)
    if found is None:
        return None
    per_host = _ranks_per_host(environ)
    each = (itertools.repeat(host, per_host) for host in found)
    return tuple(itertools.islice(itertools.chain.from_iterable(each), world_size))


def _launched(num_ranks: int, environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """The attempt's short host names when goodput launched this process (None when it did
    not), after checking they hold ranks 0 to ``num_ranks - 1``."""
    path = environ.get(HOSTFILE_VAR)
    if path is None:
        return None
    _, short = _short_hosts(path)
    per_host = _ranks_per_host(environ)
    needed = host_index(num_ranks - 1, per_host) + 1
    if needed > len(short):
        raise GoodputError(
            f"{HOSTFILE_VAR} {path}",
            f"names {len(short):,} hosts, but rank {num_ranks - 1:,} at "
            f"{LOCAL_WORLD_SIZE_VAR}={per_host} runs on host {needed:,}",
            HOSTFILE_FIX,
        )
    return short


def _ranks_per_host(environ: Mapping[str, str]) -> int:
    text = environ.get(LOCAL_WORLD_SIZE_VAR, "")
    if not COUNT.fullmatch(text) or int(text) == 0:
        raise GoodputError(
            LOCAL_WORLD_SIZE_VAR,
            f"{text[:20]!r} is not a count of ranks a host, with {HOSTFILE_VAR} set",
            f"{HOSTFILE_FIX}; it sets both",
        )
    return int(text)


@functools.cache
def _short_hosts(path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The host file's names and their short forms, read once per process: the launcher names a
    file by its contents (``LaunchPlan.hostfile``), so one path is one list. Strict: a regular
    file of at most ``MAX_HOSTS`` names, each whole, once, one a line, the last line ended."""
    where = f"{HOSTFILE_VAR} {path}"
    if not os.path.isabs(path):
        raise GoodputError(where, "is not an absolute path", HOSTFILE_FIX)
    try:
        text = read_text(path, MAX_LAUNCH_HOSTS_BYTES)
    except GoodputError as error:  # missing, a folder, a link loop, too big, not UTF-8
        raise GoodputError(f"{HOSTFILE_VAR} {error.where}", error.what, HOSTFILE_FIX) from None
    lines = text.split("\n")
    if lines.pop() != "" or not lines:
        what = "names no host" if not text else "does not end with a newline (cut short?)"
        raise GoodputError(where, what, HOSTFILE_FIX)
    if len(lines) > MAX_HOSTS:
        raise GoodputError(where, f"names more than {MAX_HOSTS:,} hosts", HOSTFILE_FIX)
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not HOSTNAME.fullmatch(line) or line in seen:
            shown = line if len(line) <= 80 else line[:77] + "..."
            what = "is not a host name" if line not in seen else "names a host twice"
            raise GoodputError(f"{where}:{number}", f"{shown!r} {what}", HOSTFILE_FIX)
        seen.add(line)
    return tuple(lines), tuple(short_name(host) for host in lines)


def parse_store_address(text: str) -> tuple[str, int]:
    """``RECOVERY_STORE_VAR``'s ``HOST:PORT``, strictly: a host name or IPv4 address, a port in
    1..65535."""
    host, colon, port = text.rpartition(":")
    if not colon or not HOSTNAME.fullmatch(host) or not COUNT.fullmatch(port):
        raise _bad_var(RECOVERY_STORE_VAR, text, "HOST:PORT")
    if not 1 <= int(port) <= 65535:
        raise _bad_var(RECOVERY_STORE_VAR, text, "a port in 1..65535")
    return host, int(port)


def parse_spare_id(text: str) -> int:
    """``SPARE_VAR``'s number: an integer in [0, ``MAX_SPARES``)."""
    if not COUNT.fullmatch(text) or int(text) >= MAX_SPARES:
        raise _bad_var(SPARE_VAR, text, f"an integer in [0, {MAX_SPARES})")
    return int(text)


def _bad_var(name: str, text: str, wanted: str) -> GoodputError:
    return GoodputError.usage(
        name, f"{text[:80]!r} is not {wanted}", "it is goodput launch --in-process's: do not set it"
    )
