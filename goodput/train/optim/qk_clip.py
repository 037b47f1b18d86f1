"""QK-clip: keep every attention head's largest logit at or below ``[optim] qk_clip`` (tau).

Attention logits that grow without bound are how Muon runs diverge late (Kimi K2, arXiv
2507.20534, which clipped at tau = 100). Each attention tracks, per query head, the largest
causal logit q.k / sqrt(e) its forwards saw in the step (``model.max_logits``: one more q.kT per
layer and micro-batch, a block of queries at a time). After the optimizer step, a head whose
largest logit S passed tau has its query rows of ``wq`` scaled by tau / S, so the same inputs
would now give at most tau. Only the query side is scaled: under grouped-query attention one key
head serves several query heads with different factors (K2 leaves the shared key alone the same
way), and scaling q alone scales the head's logits by exactly that factor.

The largest logit is taken over the whole global batch (a max over the token group) and, under
tensor parallelism, gathered over the heads' ranks, so every rank scales the same rows by the
same factors; the rows of a sharded ``wq`` are scaled where they live. Not with context
parallelism: a rank's queries see only some keys outside the ring kernel (refused in the
config).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from goodput.beacon import current
from goodput.train.model import Attention
from goodput.train.parallel.mesh import ParallelMesh


class QkClip:
    """The clip of one run's parts on this rank, after every update: ``apply`` returns the
    step's largest logit for the record (``max_attention_logit``)."""

    def __init__(self, tau: float, parts: Sequence[nn.Module], mesh: ParallelMesh) -> None:
        self.tau, self.parts, self.mesh = tau, parts, mesh
        track_logits(parts)

    @classmethod
    def when_on(
        cls, tau: float | None, parts: Sequence[nn.Module], mesh: ParallelMesh
    ) -> QkClip | None:
        """The clip at ``[optim] qk_clip`` = ``tau``; None when it is off."""
        return None if tau is None else cls(tau, parts, mesh)

    def describe(self) -> str:
        return f"train: qk-clip at {self.tau:g}"

    def apply(self) -> float:
        tp_group = self.mesh.tp_mesh.get_group() if self.mesh.degrees.tp > 1 else None
        return clip(self.parts, self.tau, self.mesh.token_group, tp_group)


def attentions(parts: Sequence[nn.Module]) -> list[Attention]:
    return [m for part in parts for m in part.modules() if isinstance(m, Attention)]


def track_logits(parts: Sequence[nn.Module]) -> None:
    """Start tracking every attention's largest logit per head, afresh (empty: sized by the
    first forward, which knows how many heads this rank computes)."""
    for attention in attentions(parts):
        attention.max_logit_h = torch.empty(0, device=attention.inv_freq.device)


def clip(
    parts: Sequence[nn.Module],
    tau: float,
    token_group: dist.ProcessGroup | None,
    tp_group: dist.ProcessGroup | None,
) -> float:
    """Scale the query rows of every head whose largest logit passed ``tau``; return the
    model's largest logit (before clipping; every rank's layers) and restart the tracking."""
    largest = -math.inf
    for attention in attentions(parts):
        local_h = attention.max_logit_h
        assert local_h is not None, "track_logits turns tracking on before the first forward"
        if not local_h.numel():  # no forward since the last clip
            continue
        if _spans_ranks(token_group):
            with current().collective("optim.reduce"):
                dist.all_reduce(local_h, op=dist.ReduceOp.MAX, group=token_group)
        heads_h = _gathered(local_h, tp_group)
        largest = max(largest, float(heads_h.max()))
        factor_h = (tau / heads_h).clamp(max=1.0)
        if bool((factor_h < 1).any()):
            _scale_query_rows(attention.wq.weight, factor_h, attention.cfg.head_dim)
    track_logits(parts)
    # The metric is the whole model's: other pipeline stages hold other layers.
    overall = torch.tensor(largest, device=next(parts[0].parameters()).device)
    if _spans_ranks(None):
        with current().collective("optim.reduce"):
            dist.all_reduce(overall, op=dist.ReduceOp.MAX)
    return float(overall)


def _spans_ranks(group: dist.ProcessGroup | None) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _gathered(local_h: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every head's value, in head order, from each tensor-parallel rank's share of them."""
    if tp_group is None or not _spans_ranks(tp_group):
        return local_h
    shares = [torch.empty_like(local_h) for _ in range(dist.get_world_size(tp_group))]
    with current().collective("optim.reduce"):
        dist.all_gather(shares, local_h, group=tp_group)
    return torch.cat(shares)


@torch.no_grad()
def _scale_query_rows(weight: torch.Tensor, factor_h: torch.Tensor, head_dim: int) -> None:
    scale = factor_h.repeat_interleave(head_dim)[:, None].expand(weight.shape).to(weight.dtype)
    if isinstance(weight, DTensor):
        # Sliced to the weight's own layout locally (no data moves: every rank has the factors).
        scale = distribute_tensor(scale, weight.device_mesh, weight.placements, src_data_rank=None)
    weight.mul_(scale)
