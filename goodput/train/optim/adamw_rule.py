"""The AdamW update of one parameter, and ``MatrixOptimizer``, the shape Muon and Mano share:
their own rule for the groups that say ``"matrix": True`` (the hidden matrices), AdamW for the
others (embeddings, the output head, norm gains, biases).

The semantics are ``torch.optim.AdamW``'s single-tensor path (``foreach=False``): decoupled
decay θ ← θ(1 − lr·wd), bias-corrected first and second moments, ε added to the corrected root.
State per parameter: ``exp_avg``, ``exp_avg_sq`` (shaped like the parameter, DTensors where it
is one) and ``step`` (a CPU scalar tensor, as torch keeps it). Every operation is elementwise, so
a sharded parameter is updated shard by shard with no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from goodput.train.dtensors import local_grad, local_tensor


def init_adamw_state(state: dict, parameter: torch.Tensor) -> None:
    """Zero moments and a zero step count, the first time ``parameter`` is stepped."""
    if "step" not in state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)


def adamw_step(
    parameter: torch.Tensor,
    state: dict,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step of ``parameter`` by its gradient in place, its moments and step count in
    ``state``."""
    init_adamw_state(state, parameter)
    beta1, beta2 = betas
    # Elementwise throughout: this rank's shards stand for the whole tensors.
    param, grad = local_tensor(parameter), local_grad(parameter)
    exp_avg, exp_avg_sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
    state["step"] += 1
    step = state["step"].item()
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denominator = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denominator, value=-step_size)


class MatrixOptimizer(torch.optim.Optimizer):
    """A matrix rule (``matrix_step``, then ``finish`` over all the step's matrices at once, for
    what needs them together) and AdamW for every other parameter."""

    def add_param_group(self, param_group: dict) -> None:
        name = type(self).__name__
        if "matrix" not in param_group:
            raise ValueError(f'every {name} parameter group says "matrix": True or False')
        super().add_param_group(param_group)
        if param_group["matrix"]:
            for param in param_group["params"]:
                if param.ndim < 2:
                    raise ValueError(f"a {name} matrix group holds a {param.ndim}-D tensor")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        matrices = []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if group["matrix"]:
                    matrices.append((param, group))
                else:
                    adamw_step(
                        param,
                        self.state[param],
                        lr=group["lr"],
                        betas=group["betas"],
                        eps=group["eps"],
                        weight_decay=group["weight_decay"],
                    )
        self.matrix_steps(matrices)
        return loss

    def matrix_steps(self, matrices: Iterable[tuple[torch.Tensor, dict]]) -> None:
        """Step every (matrix parameter, its group) with a gradient, in parameter order (the
        same on every rank, so collectives line up)."""
        raise NotImplementedError
