"""The launcher <-> rank contract: every ``GOODPUT_*`` variable a rank reads, and the one rule of
which host a rank runs on.

Each name is defined here once, for the side that sets it and the side that reads it:

- ``GOODPUT_LAUNCH_HOSTS`` (``HOSTS_VAR``): the attempt's hosts in rank order, comma-separated;
  set by ``goodput launch`` (``launch.launchers``). With torchrun's ``LOCAL_WORLD_SIZE`` it
  names each rank's host (``rank_host``).
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

The launcher's own variables (``GOODPUT_PROFILE``, a job chain's ``GOODPUT_CHAIN_*``) are read
by the launcher alone and stay in ``launch``.

Where a rank runs (``host_index``): ranks fill the hosts in order, ``ranks_per_host`` to each,
as srun's block distribution over ``--nodelist``, mpiexec over the host file and the local launch
place them. The launcher's hang forensics, each rank's own host name (beacons, straggler lines,
snapshot partners, injected device errors) and ``goodput chaos`` all use that rule.

Standard library only, importing nothing of goodput: the launcher, the trainer, the
checkpoint's snapshots and the fault hooks all read it.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping

HOSTS_VAR = "GOODPUT_LAUNCH_HOSTS"
HEARTBEAT_VAR = "GOODPUT_HEARTBEAT"
BEACON_DIR_VAR = "GOODPUT_BEACON_DIR"
EVICT_VAR = "GOODPUT_EVICT_STRAGGLERS"
PROBE_HOST_VAR = "GOODPUT_PROBE_HOST"
FAULTS_VAR = "GOODPUT_FAULTS"
DEVICE_VAR = "GOODPUT_DEVICE"

HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")  # always fullmatch: no "\n" after
COUNT = re.compile(r"[0-9]{1,9}")


def host_index(rank: int, ranks_per_host: int) -> int:
    """The index, in the attempt's hosts, of the host rank ``rank`` runs on."""
    return rank // ranks_per_host


def launcher_host(rank: int, hosts: str, local_world_size: str) -> str:
    """Rank ``rank``'s host as ``goodput launch`` named it in ``hosts`` (``HOSTS_VAR``'s value)
    with ``local_world_size`` ranks to a host, short (cut at the first dot); this machine's
    short name when they do not name it."""
    names = hosts.split(",")
    if COUNT.fullmatch(local_world_size) and int(local_world_size) > 0:
        index = host_index(rank, int(local_world_size))
        if index < len(names) and HOSTNAME.fullmatch(names[index]):
            return names[index].split(".")[0]
    return socket.gethostname().split(".")[0]


def rank_host(rank: int, environ: Mapping[str, str]) -> str:
    """This rank's host as ``goodput launch`` named it (its emulated hosts too), else this
    machine's name: the one spelling of a rank's host in beacons, straggler lines, snapshot
    partners and injected device errors."""
    ranks_per_host = environ.get("LOCAL_WORLD_SIZE", "")  # torchrun's name for it
    return launcher_host(rank, environ.get(HOSTS_VAR, ""), ranks_per_host)
