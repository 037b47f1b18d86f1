"""The wire of goodput's own per-step control traffic: a reduction of a few integers over every
rank, SUM or MAX (``Wire``). The step's vote (``train.step_vote``) and the straggler watch's
window (``stragglers.Window``) travel on it, and nothing else of goodput's does a step.

``ProcessWire`` runs it on the training's own process group (NCCL, RCCL or xccl on a device,
gloo on CPU) from the main thread, between the step's collectives: no group of its own to make
or connect. Integers, so every rank reads the same result in whatever order a reduction adds;
on a device the wait for the result is the ``tolist``. Tests run ranks as threads on
``goodput.testing.wire`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from goodput import beacon
from goodput.errors import GoodputError
from goodput.train.monitor.spread import MAX_RANKS

Op = Literal["sum", "max"]


class Wire(Protocol):
    """A reduction of a few integers over every rank (the module docstring)."""

    rank: int
    world_size: int

    def reduce(self, values: Sequence[int], op: Op, site: str) -> list[int]: ...


class ProcessWire:
    """``Wire`` over the default process group, on ``device`` (the run's: where NCCL wants its
    tensors); one rank alone reduces nothing. Each wait is bracketed for the beacon at ``site``."""

    OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.world_size > MAX_RANKS:
            raise GoodputError(
                "train",
                f"{self.world_size} ranks are more than the step's vote can name ({MAX_RANKS})",
                "run at most that many ranks",
            )

    def reduce(self, values: Sequence[int], op: Op, site: str) -> list[int]:
        if self.world_size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        with beacon.current().collective(site):
            dist.all_reduce(tensor, op=self.OPS[op])
            return tensor.tolist()
