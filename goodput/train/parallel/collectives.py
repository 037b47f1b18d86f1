"""FSDP2's own collectives, counted in the beacon (``goodput.beacon``): every all-gather of a
unit's weights (site ``fsdp.all_gather``) and every reduce-scatter of its gradients (site
``fsdp.reduce_scatter``) enters and leaves a bracket, and its time goes into ``waited_ns``.

``parallelize`` installs them on every ``FSDPModule`` (``set_custom_all_gather`` and
``set_custom_reduce_scatter``). They subclass FSDP's default comms, so FSDP's checks that a comm
is a default one still pass, and they call the very same ``dist`` functions on the very same
tensors: counting changes no bit of the training. ``CountedReduceScatter`` also feeds the
gradient tally (``grad_tally``), outside its bracket.

What the wait means: on CPU (gloo) FSDP calls them synchronously, so the bracket's time is the
wait for the last peer plus the transfer. On CUDA a NCCL call returns once the collective is
queued on FSDP's stream: ``entered``/``left`` are exact, but the time is the queueing's, not the
wait's (the wait happens on the device). HSDP's all-reduce over ``dp_replicate`` is not a custom
comm and is not counted.

FSDP's default comms are a private import, kept unguarded on purpose: the gradient tally needs
the reduce-scatter too, so a torch without them must fail loudly at import (the unit tests run
it), not train on without the tally and the counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

from goodput.beacon import current
from goodput.train.parallel.grad_tally import GradientTally


class CountedAllGather(DefaultAllGather):
    """FSDP's default all-gather inside the beacon's ``fsdp.all_gather`` bracket."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        with current().collective("fsdp.all_gather"):
            return super().__call__(output_tensor, input_tensor, group, async_op)


class CountedReduceScatter(DefaultReduceScatter):
    """FSDP's default reduce-scatter inside the ``fsdp.reduce_scatter`` bracket. ``tally``:
    first add up the squares of this rank's unreduced gradients there (``grad_tally``), outside
    the bracket (it is this rank's work, not a wait)."""

    def __init__(self, tally: GradientTally | None = None) -> None:
        self.tally = tally

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work:
        if self.tally is not None:
            self.tally.add(input_tensor)
        with current().collective("fsdp.reduce_scatter"):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
