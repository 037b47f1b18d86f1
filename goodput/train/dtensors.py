"""Reading DTensors as plain tensors, where code works on this rank's part of a value, and
completing per-tensor sums over their shards."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from goodput.beacon import current


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (the whole value when it is
    replicated), a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_of_own_tokens(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter that it applies to its own tokens only (an MoE layer
    under sequence parallelism): where the parameter is replicated, the gradient this rank
    makes is its tokens' share, a partial sum that the gradient's reduction completes
    (``aligned_grad``, or FSDP's)."""
    if not isinstance(param, DTensor):
        return param
    shares = [
        Partial() if placement.is_replicate() else placement for placement in param.placements
    ]
    return param.to_local(grad_placements=shares)


def aligned_grad(param: torch.Tensor) -> torch.Tensor:
    """``param.grad`` laid out as ``param``: a gradient whose placements differ from its
    parameter's (a tensor-parallel embedding's comes back replicated while its weight is split
    by rows) is redistributed, so the two local tensors line up."""
    grad = param.grad
    assert grad is not None
    if isinstance(grad, DTensor):
        assert isinstance(param, DTensor)
        if grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
    return grad


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param.grad``, laid out as this rank's part of ``param``."""
    return local_tensor(aligned_grad(param))


def sum_over_shards(tensors: Sequence[torch.Tensor], local_sums: torch.Tensor) -> torch.Tensor:
    """Complete per-tensor sums over the shards of DTensors, in place, and return them.

    Row ``i`` of ``local_sums`` holds sums over this rank's part of ``tensors[i]``. Summing a
    row over every mesh dimension that shards its tensor gives the sum over the whole tensor
    (any shard layout: the sums don't care which elements a rank holds). Rows are batched per
    process group: one all-reduce per group that shards any of ``tensors``, issued in the order
    the tensors come, which is the same on every rank.
    """
    rows_by_group: dict[dist.ProcessGroup, list[int]] = {}
    for row, tensor in enumerate(tensors):
        if not isinstance(tensor, DTensor):
            continue
        for mesh_dim, placement in enumerate(tensor.placements):
            assert not placement.is_partial(), "a partial parameter has no local sums"
            if not placement.is_replicate():  # Shard, or FSDP-over-TP's _StridedShard
                group = tensor.device_mesh.get_group(mesh_dim)
                rows_by_group.setdefault(group, []).append(row)
    for group, rows in rows_by_group.items():
        if len(rows) == len(tensors):
            with current().collective("optim.reduce"):
                dist.all_reduce(local_sums, group=group)
            continue
        index = torch.tensor(rows, device=local_sums.device)
        partial = local_sums.index_select(0, index)
        with current().collective("optim.reduce"):
            dist.all_reduce(partial, group=group)
        local_sums.index_copy_(0, index, partial)
    return local_sums
