"""Optimizers, keyed by the TOML ``kind``; docs/optimizers.md says when to pick which.

Parameter groups, the same list on every model part (a checkpoint merges part ``i``'s group
``j`` with every other part's group ``j``, so a group may be empty but is never left out):

- ``adamw``, ``lamb``, ``sophiag``: matrices with decay, then 1-D tensors (norm gains) without —
  decay would pull the gains toward zero and shrink the residual stream.
- ``muon``, ``mano``: the hidden matrices (attention and MLP projections) get the matrix update,
  grouped experts (``[experts, in, out]``) too, as stacks of matrices; the embedding, output
  head and router get AdamW with decay, the norm gains AdamW without (published practice:
  embedding and head rows see sparse, vocabulary-shaped gradients an orthogonalised step
  ignores).

AdamW uses fused kernels where the device has them (CUDA, XPU), ``foreach`` elsewhere.
``Optimizers``: one optimizer per model part — the whole model, or each pipeline stage this rank
runs — since a checkpoint names optimizer state by the parameter names of one module. SophiaG
also needs a Hessian estimate every ``sophia_hessian_interval`` steps, which the step makes
(``step.refresh_hessian``) when ``Optimizers.wants_hessian`` says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from goodput.train.config.optim import OptimConfig
from goodput.train.optim.lamb import Lamb
from goodput.train.optim.mano import Mano
from goodput.train.optim.muon import Muon
from goodput.train.optim.sophia import SophiaG
from goodput.train.parallel.mesh import ParallelMesh

# 2-D but not hidden matrices: what a matrix optimizer leaves to AdamW
NOT_HIDDEN_MATRICES = ("embedding.weight", "output.weight", "router.weight")


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


def matrix_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Hidden matrices; expert stacks (MoE models only); norm gains (AdamW, no decay); the
    other matrices (AdamW). Last, since a middle pipeline stage holds none of them: torch's
    distributed checkpoint restores an empty group's settings only when it is the last one."""
    hidden: list[nn.Parameter] = []
    stacks: list[nn.Parameter] = []
    gains: list[nn.Parameter] = []
    others: list[nn.Parameter] = []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if parameter.ndim == 1:
            gains.append(parameter)
        elif name.endswith(NOT_HIDDEN_MATRICES):
            others.append(parameter)
        else:
            (stacks if parameter.ndim == 3 else hidden).append(parameter)
    matrices = {"matrix": True, "weight_decay": weight_decay}
    return [
        {"params": hidden, "transposed": False, **matrices},
        # MoE models have no pipeline stages, so every part of theirs has this group.
        *([{"params": stacks, "transposed": True, **matrices}] if stacks else []),
        {"params": gains, "matrix": False, "weight_decay": 0.0},
        {"params": others, "matrix": False, "weight_decay": weight_decay},
    ]


def _adamw(
    model: nn.Module, cfg: OptimConfig, lr: float, replica_group: dist.ProcessGroup | None
) -> torch.optim.Optimizer:
    device_type = next(model.parameters()).device.type
    fast = {"fused": True} if device_type in ("cuda", "xpu") else {"foreach": True}
    return torch.optim.AdamW(
        parameter_groups(model, cfg.weight_decay), lr=lr, betas=cfg.betas, eps=cfg.eps, **fast
    )


def _lamb(
    model: nn.Module, cfg: OptimConfig, lr: float, replica_group: dist.ProcessGroup | None
) -> torch.optim.Optimizer:
    return Lamb(
        parameter_groups(model, cfg.weight_decay),
        lr=lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        max_weight_norm=cfg.lamb_max_weight_norm,
    )


def _sophiag(
    model: nn.Module, cfg: OptimConfig, lr: float, replica_group: dist.ProcessGroup | None
) -> torch.optim.Optimizer:
    return SophiaG(
        parameter_groups(model, cfg.weight_decay),
        lr=lr,
        betas=cfg.betas,
        rho=cfg.sophia_rho,
        weight_decay=cfg.weight_decay,
    )


def _muon(
    model: nn.Module, cfg: OptimConfig, lr: float, replica_group: dist.ProcessGroup | None
) -> torch.optim.Optimizer:
    return Muon(
        matrix_groups(model, cfg.weight_decay),
        lr=lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        ns_steps=cfg.muon_ns_steps,
        lr_rule=cfg.muon_lr_rule,
        weight_decay=cfg.weight_decay,
        betas=cfg.betas,
        eps=cfg.eps,
        replica_group=replica_group,
    )


def _mano(
    model: nn.Module, cfg: OptimConfig, lr: float, replica_group: dist.ProcessGroup | None
) -> torch.optim.Optimizer:
    return Mano(
        matrix_groups(model, cfg.weight_decay),
        lr=lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        weight_decay=cfg.weight_decay,
        betas=cfg.betas,
        eps=cfg.eps,
    )


Builder = Callable[[nn.Module, OptimConfig, float, dist.ProcessGroup | None], torch.optim.Optimizer]
KINDS: dict[str, Builder] = {
    "adamw": _adamw,
    "lamb": _lamb,
    "sophiag": _sophiag,
    "muon": _muon,
    "mano": _mano,
}


class Optimizers:
    """The optimizers of a rank's model parts, stepped together as one. ``replica_group``: the
    ranks holding the same plain (not sharded) parameters, over which Muon spreads its
    Newton-Schulz work."""

    def __init__(
        self,
        parts: list[nn.Module],
        cfg: OptimConfig,
        lr: float,
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.parts = parts
        self.cfg = cfg
        self.optimizers = [KINDS[cfg.kind](part, cfg, lr, replica_group) for part in parts]

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

    def wants_hessian(self, step: int) -> bool:
        """SophiaG estimates its Hessian after steps 1, 1 + k, 1 + 2k, ...: from the first step
        on, since before any estimate every coordinate's update is clipped to lr * sign."""
        return self.cfg.kind == "sophiag" and (step - 1) % self.cfg.sophia_hessian_interval == 0

    def update_hessian(self, num_tokens: int) -> None:
        for optimizer in self.optimizers:
            assert isinstance(optimizer, SophiaG)
            optimizer.update_hessian(num_tokens)


def replica_group(mesh: ParallelMesh) -> dist.ProcessGroup | None:
    """The ranks holding the same plain (unsharded) parameters: those of the token group."""
    return mesh.token_group if dist.get_world_size(mesh.token_group) > 1 else None
