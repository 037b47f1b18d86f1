"""Which copy of the checkpoint being resumed each host reads: its node-local one, or the saved.

A node-local copy is the folder of the same name under ``[checkpoint] local_dir``, as
``goodput broadcast --checkpoint`` copies it. A host reads it only when every file the saved
checkpoint's ``checksums.json`` names is in it with that digest; the reference digests come from
the saved checkpoint (read by rank 0, sent to all), never from the copy under test. The ranks of
a host share the hashing — the i-th of its n ranks hashes every n-th file — then every rank
learns every rank's verdict. A host whose copy is damaged says which file, in one warning line,
and reads the saved checkpoint; a host without a copy of that step reads it silently. Hosts
decide independently, which is safe: a verified copy holds the saved bytes, so DCP reads the
same data whichever copy a rank opens. A checkpoint saved without checksums cannot be verified
and is read where it was saved. Nothing is written to either copy.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from goodput.checkpoint.checksums import first_mismatch, read_checksums
from goodput.errors import GoodputError


@dataclass(frozen=True, slots=True)
class Choice:
    directory: Path  # the copy this rank reads
    num_local_hosts: int  # hosts reading their node-local copy
    num_hosts: int
    seconds: float  # spent choosing: hashing, and waiting for the other hosts' verdicts


def choose_copy(saved: Path, local_root: Path) -> Choice:
    """Collective over every rank: the copy of ``saved`` this rank should read."""
    start = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    expected: list[Any] = [None]
    if rank == 0:
        try:
            expected[0] = read_checksums(saved)
            if expected[0] is None:
                print(
                    f"warning: {saved} has no checksums.json (saved before goodput wrote them): "
                    "a node-local copy cannot be verified, reading the saved checkpoint",
                    flush=True,
                )
        except GoodputError as exc:
            print(f"warning: {exc.render()}; reading the saved checkpoint", flush=True)
    dist.broadcast_object_list(expected, src=0)
    host = socket.gethostname()
    machines: list[Any] = [None] * world_size
    dist.all_gather_object(machines, (host, _boot_id()))
    peers = [other for other, machine in enumerate(machines) if machine == machines[rank]]
    local = local_root / saved.name
    present = expected[0] is not None and local.is_dir()
    problem = None
    if present:
        share = sorted(expected[0].items())[peers.index(rank) :: len(peers)]
        problem = first_mismatch(local, dict(share))
    verdicts: list[Any] = [None] * world_size
    dist.all_gather_object(verdicts, (present, problem))
    usable = dict.fromkeys(machines, True)  # a host reads its copy only if all its ranks can
    for machine, verdict in zip(machines, verdicts, strict=True):
        usable[machine] = usable[machine] and verdict == (True, None)
    problems = [verdicts[other][1] for other in peers if verdicts[other][1] is not None]
    if problems and rank == peers[0]:
        print(
            f"warning: node-local copy {local} on {host}: {problems[0]}; "
            f"reading the saved checkpoint {saved} instead",
            flush=True,
        )
    return Choice(
        directory=local if usable[machines[rank]] else saved,
        num_local_hosts=sum(usable.values()),
        num_hosts=len(usable),
        seconds=time.perf_counter() - start,
    )


def _boot_id() -> str:
    """Linux's id of this boot, new on every machine at every boot: with the host name it
    tells apart machines whose containers share a host name, so no rank skips files that only
    a rank on another machine hashed."""
    path = Path("/proc/sys/kernel/random/boot_id")
    return path.read_text().strip() if path.is_file() else ""
