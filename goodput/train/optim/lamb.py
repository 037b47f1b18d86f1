"""LAMB (You et al. 2019): Adam's direction, rescaled per tensor by a trust ratio.

Per tensor θ with gradient g, at step t::

    m ← β1·m + (1−β1)·g ;  v ← β2·v + (1−β2)·g²
    u = (m / (1−β1^t)) / (√(v / (1−β2^t)) + ε) + λ·θ
    ρ = min(‖θ‖, max_weight_norm) / ‖u‖      (ρ = 1 when ‖θ‖ = 0 or ‖u‖ = 0)
    θ ← θ − lr·ρ·u

Invariants: ‖θ‖ and ‖u‖ are norms of the whole tensor, whatever its layout — a DTensor
(FSDP2 ``Shard(0)``, tensor-parallel ``Shard(0)``/``Shard(1)``, 2-D meshes, uneven or empty
shards) steps to the same numbers as the whole tensor in one process. The elementwise work runs
on local shards; only the two squared norms per sharded tensor travel: one all-reduce per
process group that shards any parameter (FSDP: one; FSDP × TP: one over dp and one over tp),
of 2 floats per tensor it shards. Plain and replicated tensors communicate nothing. With lr = 0
and zero gradients (how ``torch.distributed.checkpoint`` initialises a fresh optimizer's state)
no parameter changes and nothing turns NaN.

Not here: global gradient clipping (NVLAMB clips inside the optimizer; the trainer clips before
``step``), and any exemption of undecayed tensors from the trust ratio — every tensor gets it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from goodput.train.dtensors import local_grad, local_tensor, sum_over_shards


def _squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """‖tensor‖², accumulated in float32 at least (bf16 sums of squares lose the small ones)."""
    dtype = torch.promote_types(tensor.dtype, torch.float32)
    return torch.linalg.vector_norm(tensor, dtype=dtype).square()


class Lamb(torch.optim.Optimizer):
    """LAMB over standard parameter groups (keys lr, betas, eps, weight_decay,
    max_weight_norm); parameters may be plain tensors or DTensors.

    State per parameter: ``step`` (a float32 scalar tensor, on the CPU), ``exp_avg`` and
    ``exp_avg_sq`` (laid out as the parameter), so distributed checkpoints save and restore it
    exactly. Parameters without a gradient are skipped.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        max_weight_norm: float = 10.0,
    ) -> None:
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if eps <= 0:  # with ε = 0 a zero gradient gives 0/0
            raise ValueError(f"eps must be > 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if max_weight_norm <= 0:
            raise ValueError(f"max_weight_norm must be > 0, got {max_weight_norm}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "max_weight_norm": max_weight_norm,
        }
        super().__init__(params, defaults)

    # One signature covering both overloads of the base class's step (with a closure or none).
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LAMB step for every parameter with a gradient.

        Two passes over the parameters, so that no second copy of them is held: the first
        updates the moments and takes the local squared norms of θ and u, the norms are
        completed over shards in one batch, the second recomputes u and applies it.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = [
            (param, group)
            for group in self.param_groups
            for param in group["params"]
            if param.grad is not None
        ]
        if not stepped:
            return loss
        local_sums = torch.stack([self._update_moments(param, group) for param, group in stepped])
        sums = sum_over_shards([param for param, _ in stepped], local_sums)
        weight_norms, update_norms = sums.sqrt().unbind(dim=1)
        for (param, group), weight_norm, update_norm in zip(
            stepped, weight_norms, update_norms, strict=True
        ):
            trust_ratio = _trust_ratio(weight_norm, update_norm, group["max_weight_norm"])
            update = self._update(param, group)
            local_tensor(param).sub_(update.mul_(trust_ratio * group["lr"]))
        return loss

    def _update_moments(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Advance the step and the moments; return the local squared norms [‖θ‖², ‖u‖²]."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        grad = local_grad(param)
        local_tensor(state["exp_avg"]).mul_(beta1).add_(grad, alpha=1 - beta1)
        local_tensor(state["exp_avg_sq"]).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        return torch.stack(
            [_squared_norm(local_tensor(param)), _squared_norm(self._update(param, group))]
        )

    def _update(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """u = m̂ / (√v̂ + ε) + λ·θ, on this rank's part of ``param``, in a fresh tensor."""
        state = self.state[param]
        step = state["step"].item()
        beta1, beta2 = group["betas"]
        exp_avg_hat = local_tensor(state["exp_avg"]) / (1 - beta1**step)
        denominator = (local_tensor(state["exp_avg_sq"]) / (1 - beta2**step)).sqrt_()
        update = exp_avg_hat.div_(denominator.add_(group["eps"]))
        return update.add_(local_tensor(param), alpha=group["weight_decay"])


def _trust_ratio(
    weight_norm: torch.Tensor, update_norm: torch.Tensor, max_weight_norm: float
) -> torch.Tensor:
    """min(‖θ‖, max_weight_norm) / ‖u‖, or 1 when either norm is 0 (a zero-initialised
    tensor, or a zero update: ρ would be 0 or 0/0)."""
    both_positive = (weight_norm > 0) & (update_norm > 0)
    ratio = weight_norm.clamp(max=max_weight_norm) / update_norm
    return torch.where(both_positive, ratio, torch.ones_like(ratio))
