"""The sockets a rank holds for goodput's own process groups, counted on real gloo ranks: the
test of those groups and the benchmark's ``groups`` section (``benchmarks/bench_control.py``)
share this one count.

``group_sockets`` runs on a rank of ``testing.dist.run_distributed`` (a ``FileStore``
rendezvous: no store socket is counted) and counts this process's sockets three times: with the
default group alone; once the real ``Checkpointer`` and ``SnapshotStore`` have made their groups;
and once each group has been used as training uses it first (a synchronous save of a small
model, one snapshot taken, exchanged with its partner and committed). ``eager`` makes the
groups as goodput made them before issue 41: every pair connected when the group is made, and a
third such group for the step's vote (now on the default group).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.save import Checkpointer
from goodput.checkpoint.snapshot.store import SnapshotStore
from goodput.checkpoint.state import CheckpointContents
from goodput.rundir import list_checkpoints
from goodput.testing.snapshots import CONFIG_DIGEST, RUN_ID, LoaderPosition

CPU = torch.device("cpu")


def open_sockets() -> int:
    """How many TCP sockets this process holds, listening or connected, once settled
    (``settled_socket_inodes``)."""
    return len(settled_socket_inodes())


def settled_socket_inodes(deadline_s: float = 10.0) -> frozenset[str]:
    """``socket_inodes`` once the same set has been read five times in a row 0.1 s apart (or
    ``deadline_s`` has passed: the last read). Why: under load a pair's socket is out of the
    kernel's table for a moment after an eager group is made (CI, counting at one moment, saw
    one of a W = 2 group's two). Every rank counts between two barriers: a rank that has
    counted and gone on connects its lazy pairs to one still counting."""
    deadline = time.monotonic() + deadline_s
    last, same = socket_inodes(), 1
    while same < 5 and time.monotonic() < deadline:
        time.sleep(0.1)
        now = socket_inodes()
        same = same + 1 if now == last else 1
        last = now
    return last


def socket_inodes() -> frozenset[str]:
    """This process's TCP sockets, listening or connected: the inodes of its socket descriptors
    that the kernel lists in ``/proc/net/tcp`` or ``tcp6``. One in neither is counted out: gloo
    holds such a descriptor for a moment after a lazy group's first collective (made and not
    yet connected, or being closed), and no later count finds it. A set, so that what a moment
    made is told apart from what closed meanwhile (a destroyed group's sockets close late)."""
    listed: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):  # no IPv6 here
            for line in Path(table).read_text().splitlines()[1:]:
                listed.add(line.split()[9])
    held: set[str] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself held, closed since
            continue
        inode = target[len("socket:[") : -1]
        if target.startswith("socket:[") and inode in listed:
            held.add(inode)
    return frozenset(held)


@dataclass(frozen=True, slots=True)
class GroupSockets:
    """One rank's sockets at three moments, and whether the groups did their work."""

    default: int  # the default group alone
    made: int  # goodput's groups made
    used: int  # each used once: a save, a snapshot
    saved: bool  # the save is complete (its ``.complete`` marker)
    snapshot_ok: bool  # this rank's snapshot reached its holder


def eager_gloo_group(timeout: timedelta | None = None) -> dist.ProcessGroup:
    """A gloo group as goodput made its own before issue 41: every pair connected at once."""
    return dist.new_group(backend="gloo", timeout=timeout)


def hosts_of(world_size: int) -> list[str]:
    """Every rank's emulated host: one rank a host at 2 ranks, else 2 a host, so that a rank's
    partner holder and source are two other ranks."""
    per_host = 1 if world_size == 2 else 2
    return [f"h{rank // per_host}" for rank in range(world_size)]


def group_sockets(rank: int, world_size: int, tmp: str, eager: bool) -> GroupSockets:
    """On a spawned rank, ``tmp`` shared by every rank: this rank's sockets (the module
    docstring)."""
    dist.barrier()
    default = open_sockets()
    dist.barrier()
    with contextlib.ExitStack() as stack:
        if eager:
            for module in ("goodput.checkpoint.save", "goodput.checkpoint.snapshot.slots"):
                stack.enter_context(mock.patch(f"{module}.lazy_gloo_group", eager_gloo_group))
            stack.callback(dist.destroy_process_group, eager_gloo_group())  # the step vote's
        contents = _contents(rank)
        checkpointer, store = _made(Path(tmp), rank, world_size, contents)
        dist.barrier()
        made = open_sockets()
        dist.barrier()
        checkpointer.save(1, blocking=True)
        store.take(1, contents)
        snapshot_ok, _ = store.settle()
        flags = torch.tensor([0 if snapshot_ok else 1])
        dist.all_reduce(flags)  # the step's vote, which commits on every rank alike
        store.commit(flags.item() == 0)
        dist.barrier()
        used = open_sockets()
        dist.barrier()
        saved = [c.step for c in list_checkpoints(checkpointer.root) if c.complete] == [1]
        checkpointer.close()
        store.close(finished=True)
    return GroupSockets(default, made, used, saved, snapshot_ok)


def _made(
    tmp: Path, rank: int, world_size: int, contents: CheckpointContents
) -> tuple[Checkpointer, SnapshotStore]:
    """The checkpointer and the snapshot store as the trainer makes them (every rank at once)."""
    cfg = CheckpointConfig(memory_interval_steps=1, memory_dir=str(tmp))
    checkpointer = Checkpointer(cfg, tmp / "checkpoints", CPU, contents)
    store = SnapshotStore(
        cfg,
        root=tmp / "checkpoints",
        run_id=RUN_ID,
        config_digest=CONFIG_DIGEST,
        hosts=hosts_of(world_size),
        rank=rank,
        device=CPU,
        faults=None,
    )
    return checkpointer, store


def _contents(rank: int) -> CheckpointContents:
    torch.manual_seed(rank)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return CheckpointContents(
        parts=[model], optimizers=[optimizer], states={"loader": LoaderPosition()}
    )
