"""SophiaG (Liu et al. 2023): momentum preconditioned by a diagonal Hessian estimate, clipped
per coordinate so no coordinate moves more than lr in one step.

Owns ``SophiaG``. Every step, per parameter θ with gradient g::

    θ ← θ·(1 − lr·λ)
    m ← β1·m + (1−β1)·g
    θ ← θ − lr·sign(m)·min(|m| / (ρ·B_h·h + ε), 1)

and every few steps ``update_hessian(num_tokens)`` folds in a Gauss-Newton-Bartlett estimate:
``h ← β2·h + (1−β2)·ĝ⊙ĝ``, ĝ being the gradient of the loss on labels *sampled from the model*,
and records ``B_h = num_tokens`` (the tokens of that Hessian batch) as the param groups'
``"hessian_tokens"``. ρ·B_h·ĝ² estimates ρ times the per-token Fisher diagonal, so ρ does not
depend on the batch size as long as B_h is the true token count.

Invariants: before the first estimate h = 0, so every coordinate (with |m| ≥ ε) is clipped and
the update is lr·sign(m), signSGD with momentum. ``last_unclipped_fraction`` is the share of
coordinates the last step did not clip (the README's "win rate": it should peak early, then
stay within 0.1–0.5; tune ρ by it). All math is elementwise on local shards, so DTensors
(FSDP2, tensor parallel, 2-D meshes) step to the same numbers as whole tensors with no
communication, except the win rate: its per-tensor counts are completed over shards with one
all-reduce of an int64 per tensor, per process group that shards any parameter. Reading it
synchronises with the device; stepping does not. With lr = 0 and zero gradients (how
``torch.distributed.checkpoint`` initialises a fresh optimizer's state) nothing changes.

Not here: the sampled-label forward and backward (the trainer runs it and calls
``update_hessian``), and clipping gradients (the trainer clips before either call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from goodput.train.dtensors import local_grad, local_tensor, sum_over_shards
from goodput.train.parallel.mesh import ParallelMesh


class SophiaG(torch.optim.Optimizer):
    """SophiaG over standard parameter groups (keys lr, betas = (momentum, Hessian EMA), rho,
    weight_decay, eps, and ``hessian_tokens``: B_h, 0 until the first ``update_hessian``).

    State per parameter: ``step`` (a float32 scalar tensor, on the CPU), ``exp_avg`` and
    ``hessian`` (laid out as the parameter), so distributed checkpoints save and restore it
    exactly. Parameters without a gradient are skipped by ``step`` and ``update_hessian``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float] = (0.965, 0.99),
        rho: float = 0.04,
        weight_decay: float = 0.1,
        eps: float = 1e-15,
    ) -> None:
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if rho <= 0:
            raise ValueError(f"rho must be > 0, got {rho}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if eps <= 0:  # with ε = 0 a zero momentum over a zero Hessian gives 0/0
            raise ValueError(f"eps must be > 0, got {eps}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "rho": rho,
            "weight_decay": weight_decay,
            "eps": eps,
            "hessian_tokens": 0,
        }
        super().__init__(params, defaults)
        # The last step's count stays on the device until read: stepping never waits for it.
        self._unclipped_count: torch.Tensor | None = None
        self._num_coordinates = 0

    @property
    def last_unclipped_fraction(self) -> float | None:
        """The share of coordinates the last step did not clip (|m| < ρ·B_h·h + ε), over whole
        tensors; None before the first step that had gradients."""
        if self._unclipped_count is None:
            return None
        return int(self._unclipped_count) / self._num_coordinates

    # One signature covering both overloads of the base class's step (with a closure or none).
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One SophiaG step for every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped: list[torch.Tensor] = []
        local_counts: list[torch.Tensor] = []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    stepped.append(param)
                    local_counts.append(self._step_one(param, group))
        if stepped:
            counts = sum_over_shards(stepped, torch.stack(local_counts))
            self._unclipped_count = counts.sum()
            self._num_coordinates = sum(param.numel() for param in stepped)
        return loss

    def _step_one(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Decay, momentum, clipped step; return how many local coordinates were not clipped."""
        state = self._state(param)
        state["step"] += 1
        beta1, _ = group["betas"]
        weight = local_tensor(param)
        exp_avg = local_tensor(state["exp_avg"])
        weight.mul_(1 - group["lr"] * group["weight_decay"])
        exp_avg.mul_(beta1).add_(local_grad(param), alpha=1 - beta1)
        curvature = local_tensor(state["hessian"]) * (group["rho"] * group["hessian_tokens"])
        ratio = (exp_avg.abs() / curvature.add_(group["eps"])).clamp_(max=1)
        weight.addcmul_(exp_avg.sign(), ratio, value=-group["lr"])
        return (ratio < 1).sum()

    @torch.no_grad()
    def update_hessian(self, num_tokens: int) -> None:
        """Fold ``.grad`` — the gradient of the loss on labels sampled from the model, over a
        batch of ``num_tokens`` tokens — into the Hessian estimate: h ← β2·h + (1−β2)·grad²,
        and record B_h = ``num_tokens`` for the steps that follow."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        for group in self.param_groups:
            group["hessian_tokens"] = int(num_tokens)  # a JSON int: groups are saved as JSON
            _, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is not None:
                    grad = local_grad(param)
                    hessian = local_tensor(self._state(param)["hessian"])
                    hessian.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    def _state(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["hessian"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state


def label_generator(
    seed: int, step: int, mesh: ParallelMesh, device: torch.device
) -> torch.Generator:
    """The generator of step ``step``'s sampled labels: its own stream per step and token-group
    rank (other tokens, other draws), the same on the tensor-parallel ranks sharing tokens, and
    the same again after a resume."""
    rank = dist.get_rank(mesh.token_group)
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + rank) % 2**63
    return torch.Generator(device=device).manual_seed(mixed)
