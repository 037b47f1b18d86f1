"""Mano (Gu & Xie 2026, Algorithm 1, "v1"): momentum projected onto the tangent space of the
oblique manifold and normalised column- or row-wise, the axis alternating every step; AdamW for
the parameters that are not hidden matrices.

Groups: each parameter group says ``"matrix": True`` (the Mano rule) or ``False``
(``adamw_rule``); ``"transposed": True`` marks stacks stored [..., in, out] (grouped experts), so
that "column" keeps meaning a column of the [out, in] matrix. Tensors of 3 or more dims are
stacks of independent matrices.

Rule per matrix, with k = t mod 2 for the optimizer's step count t (one count for all matrices,
the largest stored, so the axis alternates once per step, not once per parameter):
M ← μM + g; U = g + μM with Nesterov, else M; along the out dim (k = 0, one norm per column) or
the in dim (k = 1, per row): θ̂ = θ / max(‖θ‖, ε); V = U − θ̂·⟨U, θ̂⟩; V̂ = V / max(‖V‖, ε);
θ ← θ(1 − lr·wd); θ ← θ − lr·0.2·√n·V̂ with n the length of the normalised dim (update RMS 0.2·lr,
AdamW's). Elementwise work and sums only, no matmul; computed in float32.

Sharding: nothing is gathered. Each rank works on its shards; a sum along a dim that a mesh dim
splits (FSDP's ``Shard(0)`` rows for k = 0, tensor parallelism's ``Shard(1)`` for k = 1) is this
rank's part, completed by an all-reduce over that mesh dim's group. Per step: two all-reduces per
set of groups (‖θ‖² with ⟨U, θ⟩, then ‖V‖²), each one flat buffer of every such matrix's
per-column (or per-row) sums, a vector per matrix; none where no mesh dim splits the summed dim
(plain replicated tensors, split experts, the other axis). A sum split over ranks rounds
differently than one summed in one place: results match one process to float32 rounding
(~1e-7 relative) and are deterministic for a given layout, so resume is bit-exact on it.
State: ``momentum_buffer`` (like the parameter) and a CPU ``step``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from goodput.beacon import current
from goodput.train.dtensors import local_grad, local_tensor
from goodput.train.optim.adamw_rule import MatrixOptimizer


@dataclass
class _Tangent:
    """One matrix parameter's step in progress, on this rank's shard."""

    param: torch.Tensor
    theta: torch.Tensor  # this rank's shard, float32
    update: torch.Tensor  # U, likewise
    dim: int  # the dim summed over (its length is n)
    groups: tuple[dist.ProcessGroup, ...]  # whose all-reduces complete a sum along dim
    lr: float
    weight_decay: float
    eps: float

    def apply(self, direction: tuple[torch.Tensor, torch.Tensor]) -> None:
        """θ ← θ(1 − lr·wd) − lr·0.2·√n·V̂, with V̂ = V · (1 / ‖V‖) in the same pass."""
        projected, inverse_norm = direction
        param = local_tensor(self.param)
        param.mul_(1 - self.lr * self.weight_decay)
        scale = -self.lr * 0.2 * math.sqrt(self.param.shape[self.dim])
        param.addcmul_(projected, inverse_norm, value=scale)


def summed_dim(ndim: int, axis: int, transposed: bool) -> int:
    """The dim that axis k normalises along: the out dim for k = 0 (per column of [out, in]),
    the in dim for k = 1 (per row)."""
    out_dim, in_dim = (ndim - 1, ndim - 2) if transposed else (ndim - 2, ndim - 1)
    return in_dim if axis else out_dim


def _groups_splitting(param: torch.Tensor, dim: int) -> tuple[dist.ProcessGroup, ...]:
    if not isinstance(param, DTensor):
        return ()
    mesh = param.device_mesh
    return tuple(
        mesh.get_group(mesh_dim)
        for mesh_dim, placement in enumerate(param.placements)
        if getattr(placement, "dim", None) is not None and placement.dim % param.ndim == dim  # type: ignore[attr-defined]
    )


def _complete_sums(tangents: list[_Tangent], partials: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each rank's partial sums along the tangents' dims made whole: one flat all-reduce per
    distinct set of groups, over each group of it in turn."""
    sums = list(partials)
    by_groups: dict[tuple[dist.ProcessGroup, ...], list[int]] = {}
    for i, tangent in enumerate(tangents):
        if tangent.groups:  # parameter order: the same on every rank, so collectives line up
            by_groups.setdefault(tangent.groups, []).append(i)
    for groups, indices in by_groups.items():
        flat = torch.cat([partials[i].reshape(-1) for i in indices])
        with current().collective("optim.reduce"):
            for group in groups:
                dist.all_reduce(flat, group=group)
        pieces = flat.split([partials[i].numel() for i in indices])
        for i, piece in zip(indices, pieces, strict=True):
            sums[i] = piece.view_as(partials[i])
    return sums


def tangent_directions(tangents: list[_Tangent]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each tangent, V (U projected off θ̂ along its dim) and 1 / max(‖V‖, ε) along it:
    V̂ = V times that, left for ``_Tangent.apply`` to fuse into the weight update. Each full-size
    operation is one pass over the matrix (memory-bound work: passes are the cost)."""
    halves = [
        torch.cat(
            [
                torch.linalg.vector_norm(t.theta, dim=t.dim, keepdim=True).square(),
                (t.update * t.theta).sum(t.dim, keepdim=True),
            ],
            t.dim,
        )
        for t in tangents
    ]
    projected = []
    for t, both in zip(tangents, _complete_sums(tangents, halves), strict=True):
        norm_sq, dot = both.split(1, t.dim)
        # θ̂⟨U, θ̂⟩ = θ · ⟨U, θ⟩ / max(‖θ‖, ε)²: one round of sums and one pass for V.
        coefficient = dot / norm_sq.clamp_min(t.eps * t.eps)
        projected.append(torch.addcmul(t.update, t.theta, coefficient, value=-1))
    norms_sq = _complete_sums(
        tangents,
        [
            torch.linalg.vector_norm(v, dim=t.dim, keepdim=True).square()
            for t, v in zip(tangents, projected, strict=True)
        ],
    )
    return [
        (v, n.sqrt().clamp_min(t.eps).reciprocal())
        for t, v, n in zip(tangents, projected, norms_sq, strict=True)
    ]


class Mano(MatrixOptimizer):
    """Mano on the ``"matrix": True`` groups, AdamW on the others (see the module docstring)."""

    def __init__(
        self,
        params: Iterable[dict],
        *,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = False,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "betas": betas,
            "eps": eps,
            "transposed": False,
        }
        super().__init__(list(params), defaults)

    def step_count(self) -> int:
        """The steps taken so far: the largest count a matrix parameter stores."""
        counts = [
            int(self.state[p]["step"].item())
            for group in self.param_groups
            if group["matrix"]
            for p in group["params"]
            if "step" in self.state[p]
        ]
        return max(counts, default=0)

    def matrix_steps(self, matrices: Iterable[tuple[torch.Tensor, dict]]) -> None:
        count = self.step_count()
        tangents = [self._momentum_step(param, group, count) for param, group in matrices]
        for tangent, direction in zip(tangents, tangent_directions(tangents), strict=True):
            tangent.apply(direction)

    def _momentum_step(self, param: torch.Tensor, group: dict, count: int) -> _Tangent:
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"].fill_(count + 1)
        grad, buffer = local_grad(param), local_tensor(state["momentum_buffer"])
        buffer.mul_(group["momentum"]).add_(grad)
        update = grad + group["momentum"] * buffer if group["nesterov"] else buffer
        dim = summed_dim(param.ndim, count % 2, group["transposed"])
        return _Tangent(
            param=param,
            theta=local_tensor(param).float(),
            update=update.float(),
            dim=dim,
            groups=_groups_splitting(param, dim),
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
        )
