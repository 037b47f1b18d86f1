"""Optimizers, keyed by the TOML ``kind``.

``adamw``: decoupled weight decay on matrices only — norm gains (1-D) are left undecayed, since
decay would pull them toward zero and shrink the residual stream. Fused kernels where the device
has them (CUDA, XPU), the multi-tensor ``foreach`` path elsewhere.

``Optimizers``: one optimizer per model part — the whole model, or each pipeline stage this rank
runs — since a checkpoint names optimizer state by the parameter names of one module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from goodput.train.optim_config import OptimConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _adamw(model: nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    device_type = next(model.parameters()).device.type
    fast = {"fused": True} if device_type in ("cuda", "xpu") else {"foreach": True}
    return torch.optim.AdamW(
        parameter_groups(model, cfg.weight_decay), lr=lr, betas=cfg.betas, eps=cfg.eps, **fast
    )


KINDS: dict[str, Callable[[nn.Module, OptimConfig, float], torch.optim.Optimizer]] = {
    "adamw": _adamw,
}


class Optimizers:
    """The optimizers of a rank's model parts, stepped together as one."""

    def __init__(self, parts: list[nn.Module], cfg: OptimConfig, lr: float) -> None:
        self.parts = parts
        self.optimizers = [KINDS[cfg.kind](part, cfg, lr) for part in parts]

    @property
    def param_groups(self) -> list[dict]:
        """Every part's groups: setting the LR in each sets it everywhere."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)
