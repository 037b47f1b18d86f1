"""One optimizer step over a global batch: the honest loss and its gradients.

The loss is the *global token-weighted mean*: every micro-batch's summed token loss
(``token_loss_sum``) is divided by the number of target tokens in the whole global batch (all
micro-batches, all data-parallel ranks, masked labels excluded), counted before the first
forward. Gradients are therefore the gradient of that one number whatever the DP size or the
grad-accumulation split — the per-micro-batch mean, which silently over-weights short or heavily
masked micro-batches, is never used. Data-parallel gradients are summed (not averaged) over the
data-parallel group for the same reason: by FSDP, whose mesh ``parallelize`` took from that same
group, or, when the model is not FSDP-sharded, here.

A step is ``forward_backward`` (the gradients of the global loss, complete on every rank when
it returns; pipeline parallelism will replace it with a schedule) then ``clip_and_step``.
During gradient accumulation FSDP reduces the gradients once, after the last micro-batch, unless
``sync_every_micro_batch`` (the memory trade-off is in ``ParallelConfig``).

MoE models add their balancing loss to the objective (averaged over micro-batches and ranks) but
never to the reported loss, which stays the language-model loss; the aux-loss-free router bias
moves once per step on the expert load summed over every micro-batch and rank.

Reused as-is by diagnostics, and ``token_loss_sum`` by evaluation (under ``no_grad``); the loop
(``loop.py``) owns everything periodic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from goodput.train.model import Transformer

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class StepResult:
    loss: float  # global token-weighted mean over the whole global batch
    grad_norm: float  # before clipping
    num_tokens: int  # target tokens in the global batch


def token_loss_sum(logits_btv: torch.Tensor, labels_bt: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the target tokens (``IGNORE_INDEX`` left out), in fp32: the
    caller divides by the token count its mean is over."""
    return F.cross_entropy(
        logits_btv.flatten(0, 1).float(),
        labels_bt.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def num_targets(labels_bt: torch.Tensor) -> int:
    return int((labels_bt != IGNORE_INDEX).sum())


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    max_grad_norm: float | None = 1.0,
    dp_group: dist.ProcessGroup | None = None,
    sync_every_micro_batch: bool = False,
) -> StepResult:
    """Forward/backward every micro-batch of this rank, then clip and step. ``dp_group``: the
    data-parallel ranks (``ParallelMesh.dp_group``; None: the default group)."""
    loss_sum, num_tokens = forward_backward(
        model, micro_batches, dp_group=dp_group, sync_every_micro_batch=sync_every_micro_batch
    )
    grad_norm = clip_and_step(model, optimizer, max_grad_norm)
    return StepResult(loss_sum / num_tokens, grad_norm, num_tokens)


def forward_backward(
    model: nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    dp_group: dist.ProcessGroup | None = None,
    sync_every_micro_batch: bool = False,
) -> tuple[float, int]:
    """(summed token loss, target tokens), both over the global batch; on return every rank
    holds the gradients of their quotient, summed over ``dp_group``."""
    distributed = dist.is_initialized() and dist.get_world_size(dp_group) > 1
    # Collectives need tensors on the backend's device (NCCL: the GPU); int64 keeps token
    # counts exact past float32's 2^24.
    device = next(model.parameters()).device
    counts = torch.tensor(
        [sum(num_targets(labels) for _, labels in micro_batches)], dtype=torch.int64, device=device
    )
    if distributed:
        dist.all_reduce(counts, group=dp_group)
    global_tokens = max(int(counts.item()), 1)
    moe_layers = model.moe_layers() if isinstance(model, Transformer) else []
    num_contributions = len(micro_batches) * (dist.get_world_size(dp_group) if distributed else 1)
    expert_loads = [torch.zeros_like(layer.tokens_per_expert) for layer in moe_layers]
    sharded = isinstance(model, FSDPModule)
    loss_sum = torch.zeros((), device=device)
    for index, (input_ids, labels) in enumerate(micro_batches):
        if sharded:
            model.set_requires_gradient_sync(  # type: ignore[operator]
                sync_every_micro_batch or index == len(micro_batches) - 1
            )
        micro_loss_sum = token_loss_sum(model(input_ids), labels)
        objective = micro_loss_sum / global_tokens
        if moe_layers:
            objective = objective + model.aux_loss() / num_contributions  # type: ignore[operator]
            for load, layer in zip(expert_loads, moe_layers, strict=True):
                load += layer.tokens_per_expert
        objective.backward()
        loss_sum += micro_loss_sum.detach()
    if distributed:
        if not sharded:  # FSDP's reduce-scatter has summed over the same group
            for parameter in model.parameters():
                if parameter.grad is not None:
                    dist.all_reduce(parameter.grad, group=dp_group)
        dist.all_reduce(loss_sum, group=dp_group)
        for load in expert_loads:
            dist.all_reduce(load, group=dp_group)
    for load, layer in zip(expert_loads, moe_layers, strict=True):
        layer.update_router_bias(load)
    return loss_sum.item(), global_tokens


def clip_and_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
) -> float:
    """Clip the gradients to ``max_grad_norm`` (None: not at all), step, zero them; return the
    gradient norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_grad_norm if max_grad_norm is not None else float("inf")
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)
