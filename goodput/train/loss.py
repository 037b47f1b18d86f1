"""The loss helpers: cross-entropy summed over target tokens (the trainer's objective before
its global division), per row (evaluation), the target count, and labels drawn from the model
(the gradient noise probe's "model" labels).

``IGNORE_INDEX`` marks a position that is not a target (padding, a prompt in evaluation); every
sum here leaves it out. Sums are fp32 whatever the logits' dtype. Vocabulary-sharded logits (a
DTensor under tensor parallelism) need the caller's ``loss_parallel`` around the cross-entropy:
it cannot nest, since the pipeline's schedule runs the loss inside its own. The trainer's step
(``step.py``), the pipeline's last stage (``pipeline.py``) and evaluation (``goodput.eval``) use
these; this module imports nothing of goodput's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


def token_loss_sum(logits_btv: torch.Tensor, labels_bt: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the target tokens (``IGNORE_INDEX`` left out), in fp32: the
    caller divides by the token count its mean is over."""
    return F.cross_entropy(
        logits_btv.flatten(0, 1).float(),
        labels_bt.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def row_loss_sums(logits_btv: torch.Tensor, labels_bt: torch.Tensor) -> torch.Tensor:
    """``token_loss_sum`` of each row apart, ``[b]`` in fp32, as a plain tensor: evaluation's
    loss (``goodput.eval.heldout``), where each row is its own sample or request. Vocabulary-
    sharded logits need the caller's ``loss_parallel`` around it, as ``token_loss_sum`` does
    (it cannot nest: the pipeline's schedule runs the loss inside its own)."""
    per_token = F.cross_entropy(
        logits_btv.flatten(0, 1).float(),
        labels_bt.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    if isinstance(per_token, DTensor):
        per_token = per_token.full_tensor()
    return per_token.view(labels_bt.shape).sum(1)


def num_targets(labels_bt: torch.Tensor) -> int:
    return int((labels_bt != IGNORE_INDEX).sum())


def labels_from_model(
    logits_btv: torch.Tensor, labels_bt: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """Labels drawn from the model's predictive distribution at every target position (masked
    positions stay masked). Vocabulary-sharded logits are gathered first, so every
    tensor-parallel rank, drawing with the same generator state, draws the same labels."""
    if isinstance(logits_btv, DTensor):
        logits_btv = logits_btv.full_tensor()
    probabilities = logits_btv.detach().float().softmax(-1).flatten(0, 1)
    drawn = torch.multinomial(probabilities, 1, generator=generator).view_as(labels_bt)
    return torch.where(labels_bt == IGNORE_INDEX, labels_bt, drawn)
