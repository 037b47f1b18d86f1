"""The step's vote: after each step every rank hands every rank what the step's hooks decide
together (``StepHooks.decide``), in a fixed number of integers whatever the world size.

A rank's ``Ballot`` (its named fields) and what comes back to every rank alike, the ``Tally``:

- ``sigterm``: the scheduler's warning reached this rank; on any rank, every rank stops
  (``Checkpointer.decide``);
- ``minutes_due``: this rank's clock says the checkpoint's minutes interval has passed
  (``Checkpointer.minutes_due``); on any rank, it counts for all;
- ``snapshot_ok``: this rank's last in-memory checkpoint completed (``SnapshotStore.settle``);
  only when it did on every rank do all commit it, else all keep the one before;
- ``busy_s``: this rank's busy time of the step (``stragglers.BusyClock``); every rank gets
  their spread (``spread.Spread``: least, median, most and the slowest rank), never W numbers.

The wire (``Wire``): one SUM of ``[sigterm, minutes_due, snapshot_failed]`` (1 or 0 from each
rank: set when the sum is above 0) and the busy time's histogram, then one MAX of its
extremes: 2 x 4.6 KB and 2 x 8 bytes at any world size, integers, so every rank reads the same
result in whatever order the reduction ran. The wire runs on the training's own process group
(NCCL, RCCL or xccl on a device, gloo on CPU), from the main thread only, between the
step's collectives: no group of its own to make or connect (``docs/design.md``, start-up at
scale). The checkpoint's flush runs its collectives on its own group from its thread, so the
two never pair up. Each wait is bracketed for the beacon (sites ``ckpt.vote``, and the
straggler watch's ``busy.window``); the caller sets the ``vote`` phase.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from goodput import beacon
from goodput.errors import GoodputError
from goodput.train.monitor import spread

Op = Literal["sum", "max"]


class Wire(Protocol):
    """A reduction of a few integers over every rank: the one way goodput's per-step control
    traffic travels (``ProcessWire`` in a run; ``goodput.testing.wire`` in tests)."""

    rank: int
    world_size: int

    def reduce(self, values: Sequence[int], op: Op, site: str) -> list[int]: ...


class ProcessWire:
    """``Wire`` over the default process group, on ``device`` (the run's: where NCCL wants its
    tensors); one rank alone reduces nothing."""

    OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.world_size > spread.MAX_RANKS:
            raise GoodputError(
                "train",
                f"{self.world_size} ranks are more than the step's vote can name "
                f"({spread.MAX_RANKS})",
                "run at most that many ranks",
            )

    def reduce(self, values: Sequence[int], op: Op, site: str) -> list[int]:
        if self.world_size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        with beacon.current().collective(site):
            dist.all_reduce(tensor, op=self.OPS[op])
            return tensor.tolist()  # on a device, the wait for the result is here


@dataclass(frozen=True, slots=True, kw_only=True)
class Ballot:
    """What this rank brings to the step's vote (see the module docstring)."""

    sigterm: bool
    minutes_due: bool
    snapshot_ok: bool
    busy_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Tally:
    """The step's vote as every rank sees it: ``sigterm`` and ``minutes_due`` true when true on
    any rank, ``snapshots_ok`` when true on every rank, ``busy`` the spread of busy times."""

    sigterm: bool
    minutes_due: bool
    snapshots_ok: bool
    busy: spread.Spread


FLAGS = 3  # sigterm, minutes_due, snapshot_failed: the SUM's first slots


def cast(wire: Wire, ballot: Ballot) -> Tally:
    """Collective: every rank's ``ballot`` in, the same ``Tally`` out on every rank."""
    flags = [int(ballot.sigterm), int(ballot.minutes_due), int(not ballot.snapshot_ok)]
    busy_us = spread.micros(ballot.busy_s)
    summed = wire.reduce(flags + spread.histogram(busy_us), "sum", "ckpt.vote")
    most = wire.reduce(spread.extremes(busy_us, wire.rank), "max", "ckpt.vote")
    sigterm, minutes_due, snapshot_failed = (vote > 0 for vote in summed[:FLAGS])
    return Tally(
        sigterm=sigterm,
        minutes_due=minutes_due,
        snapshots_ok=not snapshot_failed,
        busy=spread.Spread.of(summed[FLAGS:], most),
    )
