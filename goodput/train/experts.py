"""The routed experts of a mixture-of-experts layer: grouped weights and expert parallelism.

``GroupedExperts`` holds a layer's experts as one weight per SwiGLU projection, ``[experts, in,
out]`` (``w1`` gate and ``w3`` up: ``[x, d, f]``; ``w2`` down: ``[x, f, d]``), and runs them on
tokens already sorted by expert: one grouped matmul per projection (``grouped_matmul``), not a
Python loop over a list of modules.

Expert parallelism (``[parallel] ep``): ``distribute_experts`` makes each grouped weight a
DTensor split by expert (``Shard(0)``) over the ``ep`` ranks, so each holds ``experts / ep`` of
them and a checkpoint still holds every expert under one name, whatever ``ep`` saved it (DCP
reshards it into any other ``ep``). Under tensor parallelism the weights are replicated over
the ``tp`` ranks, each computing its own slice of the sequence (``model.MoE``): their gradients
are each rank's share, summed over ``tp`` (``dtensors.local_of_own_tokens``).

``dispatch`` sends each token to the rank holding its expert and brings
the result back: an all-to-all of the per-expert counts, then an all-to-all of the tokens with
uneven splits (``all_to_all``, differentiable: its backward is the reverse all-to-all), expert
computation on what arrived, and the reverse all-to-all. The ``ep`` ranks are data-parallel
ranks reading different tokens; the ranks holding the same experts sum their gradients through
FSDP (``parallelize``), the ``ep`` ranks never do (they hold different experts).

Routing, capacity and balancing stay in ``model.MoE``: what arrives here is already chosen.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from goodput.train.dtensors import local_of_own_tokens

# torch._grouped_mm wants every row of its operands 16-byte aligned.
GROUPED_MM_ALIGNMENT_BYTES = 16


def grouped_matmul(x_nd: torch.Tensor, w_xde: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``x_nd`` (rows sorted by group, ``counts[i]`` rows for group i) times each group's own
    ``w_xde[i]``. torch's fused grouped matmul where it takes these operands (its CPU kernel for
    aligned widths, CUDA's for bf16 on Hopper and later), else one matmul per group: the same
    numbers either way (a test compares them)."""
    if _fused_grouped_mm_takes(x_nd, w_xde):
        offsets = torch.tensor(counts, device=x_nd.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x_nd, w_xde, offs=offsets)
    parts = [rows @ w_xde[i] for i, rows in enumerate(x_nd.split(counts))]
    return torch.cat(parts) if parts else x_nd.new_empty(0, w_xde.shape[-1])


def _fused_grouped_mm_takes(x_nd: torch.Tensor, w_xde: torch.Tensor) -> bool:
    if x_nd.dtype != w_xde.dtype or not hasattr(torch, "_grouped_mm"):
        return False
    if torch.compiler.is_compiling() and x_nd.dtype != torch.bfloat16:
        # torch 2.13's shape function for _grouped_mm (what compiling traces) takes bf16 only,
        # though its CPU kernel takes fp32: refused as "Expected inputs of BF16 type".
        return False
    aligned = all(
        width * x_nd.element_size() % GROUPED_MM_ALIGNMENT_BYTES == 0 for width in w_xde.shape[1:]
    )
    if x_nd.device.type == "cpu":
        return aligned
    if x_nd.device.type == "cuda":
        hopper = torch.cuda.get_device_capability(x_nd.device) >= (9, 0)
        return aligned and hopper and x_nd.dtype == torch.bfloat16
    return False


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as three grouped weights (see the module docstring)."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))  # gate
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))  # down: the output
        # The ep ranks' group once ``distribute_experts`` split the experts; None: all are here.
        self.expert_group: dist.ProcessGroup | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default per expert, U(-1/sqrt(in), 1/sqrt(in)), so that experts built
        alone are initialised (a whole ``Transformer`` draws its own init over them)."""
        for weight in (self.w1, self.w3, self.w2):
            bound = 1 / math.sqrt(weight.shape[1])
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x_nd: torch.Tensor, counts_x: torch.Tensor) -> torch.Tensor:
        """Each row of ``x_nd`` through its expert: rows sorted by expert, ``counts_x[e]`` of
        them for expert ``e`` (of all experts, wherever they live); the results in that order."""
        if self.expert_group is None:
            return self.compute(x_nd, counts_x.tolist())
        return dispatch(self, x_nd, counts_x, self.expert_group)

    def compute(self, x_nd: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on rows sorted by them, ``counts`` rows each."""
        w1, w3, w2 = (local_of_own_tokens(w) for w in (self.w1, self.w3, self.w2))
        hidden = F.silu(grouped_matmul(x_nd, w1, counts)) * grouped_matmul(x_nd, w3, counts)
        return grouped_matmul(hidden, w2, counts)


def distribute_experts(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every ``GroupedExperts`` of ``model`` as DTensors on ``mesh`` (in place): split by expert
    over its ``ep`` dimension, replicated over its ``tp`` one."""
    names = mesh.mesh_dim_names or ()
    placements = [Shard(0) if name == "ep" else Replicate() for name in names]
    for experts in model.modules():
        if isinstance(experts, GroupedExperts):
            for name in ("w1", "w3", "w2"):
                full = getattr(experts, name)
                split = distribute_tensor(full.data, mesh, placements, src_data_rank=None)
                setattr(experts, name, nn.Parameter(split, requires_grad=full.requires_grad))
            if "ep" in names:
                experts.expert_group = mesh.get_group("ep")


def dispatch(
    experts: GroupedExperts, x_nd: torch.Tensor, counts_x: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Expert parallelism: rows sorted by expert go to the rank holding their expert (rank
    ``e // (experts / ep)`` of ``group``), are computed there, and come back in their order."""
    num_ranks = dist.get_world_size(group)
    num_local = counts_x.numel() // num_ranks
    # received_sl[s, l]: the rows rank s sends for this rank's local expert l.
    received_sl = torch.empty_like(counts_x)
    dist.all_to_all_single(received_sl, counts_x.contiguous(), group=group)
    received_sl = received_sl.view(num_ranks, num_local)
    send_splits = counts_x.view(num_ranks, num_local).sum(1).tolist()
    receive_splits = received_sl.sum(1).tolist()
    arrived = all_to_all(x_nd, receive_splits, send_splits, group)
    # They arrive source-major (each source's rows by expert); the experts want expert-major.
    order = _expert_major_order(received_sl)
    computed = experts.compute(arrived[order], received_sl.sum(0).tolist())
    back = torch.empty_like(computed).index_copy(0, order, computed)
    return all_to_all(back, send_splits, receive_splits, group)


def _expert_major_order(counts_sl: torch.Tensor) -> torch.Tensor:
    """The permutation that takes rows laid out source-major (``counts_sl[s, l]`` rows from
    source ``s`` for local expert ``l``, sources outermost) to expert-major."""
    flat = counts_sl.flatten()
    starts_sl = (flat.cumsum(0) - flat).view_as(counts_sl)
    lengths = counts_sl.t().flatten()  # expert-major segments ...
    starts = starts_sl.t().flatten()  # ... and where each begins in the source-major rows
    segment_starts = lengths.cumsum(0) - lengths
    position = torch.arange(int(lengths.sum()), device=counts_sl.device)
    return torch.repeat_interleave(starts - segment_starts, lengths) + position


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x_nd: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)  # type: ignore[attr-defined]
        ctx.group = group  # type: ignore[attr-defined]
        return _exchange(x_nd, output_splits, input_splits, group)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_nd: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits  # type: ignore[attr-defined]
        return _exchange(grad_nd, input_splits, output_splits, ctx.group), None, None, None  # type: ignore[attr-defined]


def _exchange(
    x_nd: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x_nd.new_empty(sum(output_splits), *x_nd.shape[1:])
    dist.all_to_all_single(out, x_nd.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all(
    x_nd: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: ``input_splits[r]`` rows go to rank ``r``,
    ``output_splits[r]`` arrive from it, in rank order."""
    result = _AllToAll.apply(x_nd, output_splits, input_splits, group)
    assert isinstance(result, torch.Tensor)
    return result
