"""One optimizer step over a global batch: the honest loss and its gradients.

The loss is the *global token-weighted mean*: every micro-batch's summed token loss is divided
by the number of target tokens in the whole global batch (all micro-batches, all data-parallel
ranks, masked labels excluded), counted before the first forward. Gradients are therefore the
gradient of that one number whatever the DP size or the grad-accumulation split — the per-
micro-batch mean, which silently over-weights short or heavily masked micro-batches, is never
used. Data-parallel gradients are summed (not averaged) across ranks for the same reason: by
FSDP (see ``parallelize``) or, for replicated parameters, here.

MoE models add their balancing loss to the objective (averaged over micro-batches and ranks) but
never to the reported loss, which stays the language-model loss; the aux-loss-free router bias
moves once per step on the expert load summed over every micro-batch and rank.

Reused as-is by diagnostics; the loop (``loop.py``) owns everything periodic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from goodput.train.model import Transformer

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class StepResult:
    loss: float  # global token-weighted mean over the whole global batch
    grad_norm: float  # before clipping
    num_tokens: int  # target tokens in the global batch


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    max_grad_norm: float | None = 1.0,
    dp_group: dist.ProcessGroup | None = None,
) -> StepResult:
    """Forward/backward every micro-batch of this rank, reduce, clip, step."""
    distributed = dist.is_initialized() and dist.get_world_size(dp_group) > 1
    # Collectives need tensors on the backend's device (NCCL: the GPU); int64 keeps token
    # counts exact past float32's 2^24.
    device = next(model.parameters()).device
    local_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)
    counts = torch.tensor([local_tokens], dtype=torch.int64, device=device)
    if distributed:
        dist.all_reduce(counts, group=dp_group)
    global_tokens = max(int(counts.item()), 1)
    moe_layers = model.moe_layers() if isinstance(model, Transformer) else []
    num_contributions = len(micro_batches) * (dist.get_world_size(dp_group) if distributed else 1)
    expert_loads = [torch.zeros_like(layer.tokens_per_expert) for layer in moe_layers]
    loss_sum = torch.zeros((), device=device)
    for input_ids, labels in micro_batches:
        logits = model(input_ids)
        token_loss_sum = F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        objective = token_loss_sum / global_tokens
        if moe_layers:
            objective = objective + model.aux_loss() / num_contributions  # type: ignore[operator]
            for load, layer in zip(expert_loads, moe_layers, strict=True):
                load += layer.tokens_per_expert
        objective.backward()
        loss_sum += token_loss_sum.detach()
    if distributed:
        for parameter in model.parameters():
            # FSDP-sharded parameters (DTensors) were already summed by FSDP's reduce-scatter.
            if parameter.grad is not None and not isinstance(parameter, DTensor):
                dist.all_reduce(parameter.grad, group=dp_group)
        dist.all_reduce(loss_sum, group=dp_group)
        for load in expert_loads:
            dist.all_reduce(load, group=dp_group)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_grad_norm if max_grad_norm is not None else float("inf")
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for load, layer in zip(expert_loads, moe_layers, strict=True):
        layer.update_router_bias(load)
    return StepResult(
        loss=loss_sum.item() / global_tokens,
        grad_norm=float(grad_norm),
        num_tokens=int(global_tokens),
    )
