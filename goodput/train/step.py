"""One optimizer step over a global batch: the honest loss and its gradients.

The loss is the *global token-weighted mean*: every micro-batch's summed token loss
(``loss.token_loss_sum``) is divided by the number of target tokens in the whole global batch (all
micro-batches, all data-parallel ranks, masked labels excluded), counted before the first
forward. Gradients are therefore the gradient of that one number whatever the DP size or the
grad-accumulation split — the per-micro-batch mean, which silently over-weights short or heavily
masked micro-batches, is never used. The sums run over the *token group*: the data-parallel
ranks, times the context-parallel ranks that each hold other tokens of the same sequences.
Gradients are summed (not averaged) over it for the same reason: by FSDP, whose mesh
``parallelize`` took from that same group, or, when the model is not FSDP-sharded, here.

A step is ``forward_backward`` (the gradients of the global loss, complete on every rank when
it returns; under pipeline parallelism ``Pipeline.forward_backward`` runs the schedule instead,
with the same objective) then ``clip_and_step``.

Every layout logs the same number. The loss is summed over the token group only:
tensor-parallel ranks hold the same loss (with ``loss_parallel`` a replicated DTensor, read
through its local value), so summing over them would multiply it by ``tp``, and reading a
DTensor's value without the data-parallel sum would divide it by ``dp`` — the seed's bug. The
gradient norm is over the whole model: DTensor norms are completed over their shards, then
pipeline stages' squared norms are summed.
During gradient accumulation FSDP reduces the gradients once, after the last micro-batch, unless
``sync_every_micro_batch`` (the memory trade-off is in ``ParallelConfig``).

The non-finite guard: the gradient norm the clip computes (over the reduced gradients, so the
same on every rank, with no collective of its own) is checked before the optimizer steps; when
it is inf or NaN the optimizer does not step (weights and optimizer state stay as they were),
the gradients are zeroed, and the result says ``skipped``. (FSDP's clip does one all-reduce
for the norm, the one it always did.) The step still counts: its batch was
consumed and the LR schedule moves on, so a skip changes nothing about which batch or LR a later
step gets. ``SkippedSteps`` counts skips and stops the run at ``train.max_skipped_steps`` in a
row; its count is part of every checkpoint, so a resumed run skips and stops as a straight one.

MoE models add their balancing loss to the objective (averaged over micro-batches and
data-parallel ranks; each layer's joins backward through its own output, ``model.MoE``) but
never to the reported loss, which stays the language-model loss; the aux-loss-free router bias
moves once per step on the expert load summed over every micro-batch and rank. That load, and
the assignments the capacity factor dropped, are the step's ``ExpertLoad`` (metrics), over
every pipeline stage.
Split experts (``ep``) are DTensors on a mesh of their own, so the gradient norm is taken per
mesh and the squares summed.

Every wait on the peers is bracketed in the process's beacon (``goodput.beacon``: sites
``step.tokens``, ``step.grads``, ``step.sums``, ``step.moe``, ``step.norm``, ``step.pp``; FSDP's
own all-gathers and reduce-scatters are ``collectives.py``'s), and the beacon's phase moves to
``forward``, ``backward`` and ``optimizer``: the loop's busy time and the hang forensics read
them. Counting touches no tensor.

A step's input is this rank's share of the global batch in micro-batches (``micro_batches_of``,
which the in-loop eval cuts its rows with too). Reused as-is by diagnostics (the loss helpers,
which evaluation shares, are ``loss.py``); the loop (``loop.py``) owns everything periodic.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from goodput.beacon import current
from goodput.errors import GoodputError
from goodput.train.dtensors import local_tensor
from goodput.train.loss import labels_from_model, num_targets, token_loss_sum
from goodput.train.model import MoE, Transformer
from goodput.train.parallel.float8 import precompute_weight_scales
from goodput.train.parallel.grad_tally import GradientTally

if TYPE_CHECKING:
    from goodput.train.config.run import BatchPlan
    from goodput.train.optim.optimizers import Optimizers
    from goodput.train.parallel.pipeline import Pipeline
    from goodput.train.ring_attention import ContextLayout


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    """How a step's tokens spread over the experts, every micro-batch and rank together."""

    imbalance: float  # the most loaded expert's tokens over the mean, worst MoE layer
    dropped_tokens: int  # token-to-expert assignments over capacity, all layers


class UpdateObserver(Protocol):
    """Looks at the weights just before and just after the optimizer updates them (the bf16
    freeze check, ``monitor/diagnostics.py``)."""

    def before_step(self) -> None: ...

    def after_step(self) -> None: ...


@dataclass(frozen=True, slots=True)
class BackwardResult:
    loss_sum: float  # summed token loss over the global batch
    num_tokens: int  # target tokens in the global batch
    expert_load: ExpertLoad | None = None  # MoE models only
    # The mean over data-parallel ranks of |gradient of a rank's own mean loss|^2, measured where
    # the layout lets a rank's gradient be its own tokens' (``GradientTally``); else None.
    small_batch_sq_norm: float | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    loss: float  # global token-weighted mean over the whole global batch
    grad_norm: float  # before clipping; inf or NaN when the step was skipped
    num_tokens: int  # target tokens in the global batch
    skipped: bool = False  # the gradient norm was not finite: the optimizer did not step
    expert_load: ExpertLoad | None = None  # MoE models only
    small_batch_sq_norm: float | None = None  # BackwardResult's, for the gradient noise scale


@dataclass(slots=True)
class SkippedSteps:
    """The guard's count of skipped steps, in all and in a row; saved in every checkpoint."""

    max_in_a_row: int  # train.max_skipped_steps
    total: int = 0
    in_a_row: int = 0

    def count(self, step: int, skipped: bool) -> GoodputError | None:
        """Count step ``step``; the error that stops the run once ``max_in_a_row`` steps in a
        row were skipped, else None."""
        self.total += skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if self.in_a_row < self.max_in_a_row:
            return None
        return GoodputError(
            "train",
            f"stopped at step {step}: the gradient norm was not finite for {self.in_a_row} "
            f"steps in a row (steps {step - self.in_a_row + 1}-{step}; "
            f"train.max_skipped_steps = {self.max_in_a_row})",
            "the run diverged or its data is broken: resume from an earlier checkpoint with a "
            "lower learning rate, or check the data of those steps",
        )

    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.total, "skipped_in_a_row": self.in_a_row}

    def load_state_dict(self, train_state: Mapping[str, Any]) -> None:
        """The counts a checkpoint's train state carries (checked as data by
        ``checkpoint.load.check_train_state``); none before the guard existed."""
        self.total = train_state.get("skipped_steps", 0)
        self.in_a_row = train_state.get("skipped_in_a_row", 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSettings:
    """What every step of a run does alike (``train_step``'s settings). ``token_group``: the
    ranks whose tokens make up the global batch (``ParallelMesh.token_group``: data x context
    parallel; None: the default group); ``data_group``: its data-parallel ranks, each with
    whole micro-batches (``ParallelMesh.data_group``; None: the default group).
    ``positions_t``: the positions of this rank's tokens in their sequences (context
    parallelism; None: 0..t-1). ``tally``: measure each rank's own gradient norm
    (``grad_tally``)."""

    max_grad_norm: float | None = 1.0  # None: no clipping
    token_group: dist.ProcessGroup | None = None
    data_group: dist.ProcessGroup | None = None
    positions_t: torch.Tensor | None = None
    sync_every_micro_batch: bool = False
    tally: GradientTally | None = None


def micro_batches_of(
    batch: tuple[torch.Tensor, torch.Tensor],
    context: ContextLayout | None,
    cp_rank: int,
    plan: BatchPlan,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the global batch (under context parallelism its chunks of each
    sequence), on ``device``, in micro-batches."""
    input_ids, labels = batch
    if context is not None:
        input_ids, labels = (context.split(t, cp_rank) for t in (input_ids, labels))
    return list(
        zip(
            input_ids.to(device).split(plan.micro_batch_size),
            labels.to(device).split(plan.micro_batch_size),
            strict=True,
        )
    )


def train_step(
    model: nn.Module | Pipeline,
    optimizer: torch.optim.Optimizer | Optimizers,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    settings: StepSettings = StepSettings(),
    *,
    freeze: UpdateObserver | None = None,
    hessian_labels: torch.Generator | None = None,
    inject_nan: bool = False,
) -> StepResult:
    """Forward/backward every micro-batch of this rank (through the pipeline's schedule when
    ``model`` is a ``Pipeline``), then clip and step (or skip, on a non-finite gradient norm),
    as the run's ``settings`` say. This step's own: ``freeze`` checks its update for entries
    that rounded away; ``hessian_labels``: after the step, refresh SophiaG's Hessian estimate
    on labels drawn with this generator (``refresh_hessian``); ``inject_nan``: an injected
    fault (``goodput.faults``)."""
    token_group = settings.token_group
    if isinstance(model, nn.Module):
        result = forward_backward(
            model,
            micro_batches,
            token_group=token_group,
            data_group=settings.data_group,
            positions_t=settings.positions_t,
            sync_every_micro_batch=settings.sync_every_micro_batch,
            tally=settings.tally,
            inject_nan=inject_nan,
        )
        grad_norm = clip_and_step([model], optimizer, settings.max_grad_norm, freeze=freeze)
    else:
        result = pipeline_forward_backward(
            model,
            micro_batches,
            token_group=token_group,
            data_group=settings.data_group,
            inject_nan=inject_nan,
        )
        grad_norm = clip_and_step(
            model.parts, optimizer, settings.max_grad_norm, model.pp_group, model.tied_copy, freeze
        )
    if hessian_labels is not None and math.isfinite(grad_norm):
        assert not isinstance(optimizer, torch.optim.Optimizer), "SophiaG runs as Optimizers"
        refresh_hessian(
            model,
            optimizer,
            micro_batches,
            hessian_labels,
            token_group=token_group,
            positions_t=settings.positions_t,
        )
    return StepResult(
        result.loss_sum / result.num_tokens,
        grad_norm,
        result.num_tokens,
        not math.isfinite(grad_norm),
        result.expert_load,
        result.small_batch_sq_norm,
    )


def refresh_hessian(
    model: nn.Module | Pipeline,
    optimizer: Optimizers,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    generator: torch.Generator,
    *,
    token_group: dist.ProcessGroup | None = None,
    positions_t: torch.Tensor | None = None,
) -> None:
    """SophiaG's Gauss-Newton-Bartlett Hessian estimate: one more forward and backward of the
    step's batch, on labels drawn from the model (``generator``), whose squared gradient the
    optimizer folds into its Hessian average. A non-finite estimate is dropped."""
    if isinstance(model, nn.Module):
        result = forward_backward(
            model,
            micro_batches,
            token_group=token_group,
            positions_t=positions_t,
            sample_labels=generator,
        )
        parts: Sequence[nn.Module] = [model]
    else:
        result = pipeline_forward_backward(
            model, micro_batches, token_group=token_group, sample_labels=generator
        )
        parts = model.parts
    grads = [p.grad for part in parts for p in part.parameters() if p.grad is not None]
    if math.isfinite(float(_total_norm(grads))) and math.isfinite(result.loss_sum):
        optimizer.update_hessian(result.num_tokens)
    optimizer.zero_grad(set_to_none=True)


def _global_tokens(
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    token_group: dist.ProcessGroup | None,
) -> int:
    """Target tokens of the whole global batch, counted before the first forward."""
    # Collectives need tensors on the backend's device (NCCL: the GPU); int64 keeps token
    # counts exact past float32's 2^24.
    counts = torch.tensor(
        [sum(num_targets(labels) for _, labels in micro_batches)], dtype=torch.int64, device=device
    )
    if dist.is_initialized() and dist.get_world_size(token_group) > 1:
        with current().collective("step.tokens"):
            dist.all_reduce(counts, group=token_group)
    return max(int(counts.item()), 1)


def forward_backward(
    model: nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    token_group: dist.ProcessGroup | None = None,
    data_group: dist.ProcessGroup | None = None,
    positions_t: torch.Tensor | None = None,
    sync_every_micro_batch: bool = False,
    tally: GradientTally | None = None,
    sample_labels: torch.Generator | None = None,
    inject_nan: bool = False,
) -> BackwardResult:
    """The summed token loss and the target tokens, both over the global batch; on return every
    rank holds the gradients of their quotient, summed over ``token_group`` (an MoE model's
    routing over ``data_group``: ``finish_routing``). ``tally``: measure
    this rank's own gradient on the way (``grad_tally``; its FSDP reduce-scatters feed it).
    ``sample_labels``: train on labels drawn from the model's own predictions with this
    generator instead (SophiaG's Hessian estimate: the LM loss only, no expert balancing, no
    router-bias move). ``inject_nan`` puts a NaN into this rank's gradients before they are
    summed over the ranks, where a real one would come from."""
    distributed = dist.is_initialized() and dist.get_world_size(token_group) > 1
    device = next(model.parameters()).device
    if tally is not None:
        tally.take()  # what a pass without it left there (SophiaG's Hessian estimate) is not ours
    global_tokens = _global_tokens(micro_batches, device, token_group)
    moe_layers = model.moe_layers() if isinstance(model, Transformer) else []
    start_routing(moe_layers, len(micro_batches), data_group, balancing=sample_labels is None)
    sharded = isinstance(model, FSDPModule)
    loss_sum = torch.zeros((), device=device)
    beacon = current()
    for index, (input_ids, labels) in enumerate(micro_batches):
        if sharded:
            model.set_requires_gradient_sync(  # type: ignore[operator]
                sync_every_micro_batch or index == len(micro_batches) - 1
            )
        beacon.phase("forward")
        logits = model(input_ids, positions_t)
        # Tensor-parallel logits left as vocabulary shards: the loss and its backward run on
        # the shards.
        vocab_sharded = isinstance(logits, DTensor)
        if sample_labels is not None:
            labels = labels_from_model(logits, labels, sample_labels)
        with loss_parallel() if vocab_sharded else contextlib.nullcontext():
            micro_loss_sum = token_loss_sum(logits, labels)
            objective = micro_loss_sum / global_tokens
            beacon.phase("backward")
            objective.backward()
        loss_sum += local_tensor(micro_loss_sum.detach())
    if inject_nan:
        _put_nan(model)
    # This rank's gradient of its own mean loss, squared: the gradient of the global mean,
    # scaled by global over local tokens. Summed over the ranks with the loss, in one message.
    own_squared = torch.full((), math.nan, device=device)
    if tally is not None:
        if not sharded:
            for parameter in model.parameters():
                if parameter.grad is not None:
                    tally.add(parameter.grad)
        squared = tally.take()
        local_tokens = sum(num_targets(labels) for _, labels in micro_batches)
        if squared is not None and local_tokens:
            own_squared = squared * (global_tokens / local_tokens) ** 2
    sums = torch.stack([loss_sum, own_squared.to(loss_sum.dtype)])
    if distributed:
        if not sharded:  # FSDP's reduce-scatter has summed over the same group
            with beacon.collective("step.grads"):
                for parameter in model.parameters():
                    if parameter.grad is not None:
                        dist.all_reduce(local_tensor(parameter.grad), group=token_group)
        with beacon.collective("step.sums"):
            dist.all_reduce(sums, group=token_group)
    expert_load = None
    if moe_layers and sample_labels is None:
        expert_load = finish_routing(moe_layers, len(micro_batches), data_group)
    ranks = dist.get_world_size(token_group) if distributed else 1
    mean_own_squared = float(sums[1]) / ranks
    return BackwardResult(
        float(sums[0]),
        global_tokens,
        expert_load,
        mean_own_squared if math.isfinite(mean_own_squared) else None,
    )


def start_routing(
    layers: Sequence[MoE],
    num_micro_batches: int,
    data_group: dist.ProcessGroup | None,
    *,
    balancing: bool,
) -> None:
    """Before a step's first forward: each MoE layer's routing record emptied, and its
    balancing loss weighted as the objective weighs a micro-batch's, the mean over every
    micro-batch of every data-parallel rank (``balancing`` False: SophiaG's Hessian estimate,
    the language-model loss only)."""
    ranks = dist.get_world_size(data_group) if dist.is_initialized() else 1
    for layer in layers:
        layer.routed.clear()
        layer.aux_scale = 1 / (num_micro_batches * ranks) if balancing else 0.0


def finish_routing(
    layers: Sequence[MoE],
    num_micro_batches: int,
    data_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None = None,
) -> ExpertLoad:
    """After a step's last backward: the load of each MoE layer (its last ``num_micro_batches``
    forwards: a pipeline's schedule runs one of its own first) summed over the data-parallel
    ranks in one all-reduce — each forward counted its whole micro-batch, wherever its tokens
    were — the router biases moved on it, and the step's ``ExpertLoad``, over every stage of
    the pipeline ``pp_group`` when there is one."""
    records = [layer.routed[-num_micro_batches:] for layer in layers]
    # float64: exact counts past float32's 2^24 assignments a step.
    counts = torch.stack(
        [torch.stack([r.counts_x for r in routed]).sum(0) for routed in records]
    ).double()
    dropped = torch.stack([r.dropped for routed in records for r in routed]).sum().double()
    totals = torch.cat([counts.flatten(), dropped[None]])
    if dist.is_initialized() and dist.get_world_size(data_group) > 1:
        with current().collective("step.moe"):
            dist.all_reduce(totals, group=data_group)
    loads = totals[:-1].view_as(counts)
    for layer, load in zip(layers, loads, strict=True):
        layer.update_router_bias(load.float())
    imbalance = (loads.amax(1) / loads.mean(1).clamp(min=1e-12)).amax()
    stages = torch.stack([imbalance, totals[-1]])
    if pp_group is not None:
        with current().collective("step.pp"):
            dist.all_reduce(stages[:1], op=dist.ReduceOp.MAX, group=pp_group)
            dist.all_reduce(stages[1:], group=pp_group)
    return ExpertLoad(float(stages[0]), int(stages[1]))


def pipeline_forward_backward(
    pipeline: Pipeline,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    token_group: dist.ProcessGroup | None = None,
    data_group: dist.ProcessGroup | None = None,
    sample_labels: torch.Generator | None = None,
    inject_nan: bool = False,
) -> BackwardResult:
    """``forward_backward``'s contract, through the pipeline's schedule: this rank's
    micro-batches go in as one local batch, which the schedule cuts into its own."""
    input_ids = torch.cat([ids for ids, _ in micro_batches])
    labels = torch.cat([labels for _, labels in micro_batches])
    global_tokens = _global_tokens(micro_batches, labels.device, token_group)
    moe_layers = [layer for part in pipeline.parts for layer in part.moe_layers()]
    balancing = sample_labels is None
    start_routing(moe_layers, pipeline.num_microbatches, data_group, balancing=balancing)
    # The schedule interleaves forward and backward, and its sends and receives to the next
    # stages are torch's own: they count as this rank's work, not as waits.
    current().phase("forward")
    loss_sum = pipeline.forward_backward(input_ids, labels, global_tokens, sample_labels)
    if inject_nan:
        _put_nan(pipeline.parts[0])
    if dist.get_world_size(token_group) > 1:
        with current().collective("step.pp"):
            dist.all_reduce(loss_sum, group=token_group)
    expert_load = None
    if moe_layers and balancing:
        expert_load = finish_routing(
            moe_layers, pipeline.num_microbatches, data_group, pipeline.pp_group
        )
    return BackwardResult(loss_sum.item(), global_tokens, expert_load)


def clip_and_step(
    parts: Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Optimizers,
    max_grad_norm: float | None,
    pp_group: dist.ProcessGroup | None = None,
    uncounted: torch.Tensor | None = None,
    freeze: UpdateObserver | None = None,
) -> float:
    """Clip the gradients of ``parts`` to ``max_grad_norm`` (None: not at all), step unless
    their norm is not finite, zero them; return the gradient norm before clipping. The norm is
    the whole model's: over every shard, and every pipeline stage of ``pp_group``, leaving out
    ``uncounted`` (a pipeline's copy of a tied weight, counted where the original is).
    ``freeze``: looks at the weights and gradients just before and after the update."""
    current().phase("optimizer")
    parameters = [p for part in parts for p in part.parameters() if p.grad is not None]
    counted = [p.grad for p in parameters if p.grad is not None and p is not uncounted]
    norm = _total_norm(counted)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        squared = norm.float() ** 2
        with current().collective("step.pp"):
            dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    grad_norm = float(norm)
    if max_grad_norm is not None and math.isfinite(max_grad_norm) and math.isfinite(grad_norm):
        for group in _by_mesh(parameters):
            torch.nn.utils.clip_grads_with_norm_(group, max_grad_norm, norm)
    if math.isfinite(grad_norm):  # else skipped: weights and optimizer state stay as they were
        if freeze is not None:
            freeze.before_step()
        optimizer.step()
        precompute_weight_scales(parts)  # fp8's next all-gathers: the new weights' scales
        if freeze is not None:
            freeze.after_step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _by_mesh(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by the mesh of each DTensor (plain tensors together): DTensors on
    different meshes (split experts beside the other sharded weights) cannot meet in one op."""
    groups: dict[object, list[torch.Tensor]] = {}
    for tensor in tensors:
        mesh = tensor.device_mesh if isinstance(tensor, DTensor) else None
        groups.setdefault(mesh, []).append(tensor)
    return list(groups.values())


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``grads``, as a plain tensor: each mesh's gradients normed apart
    (``_by_mesh``), completed over their shards, and the squares summed."""
    norms = []
    for group in _by_mesh(grads) or [[]]:
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        if isinstance(norm, DTensor):  # completed over its shards: an all-reduce
            with current().collective("step.norm"):
                norm = norm.full_tensor()
        norms.append(norm)
    if len(norms) == 1:  # as it was before experts split: the same bits
        return norms[0]
    return torch.stack([norm.float() ** 2 for norm in norms]).sum().sqrt()


def _put_nan(model: nn.Module) -> None:
    """One NaN in this rank's gradient of the first parameter it holds a part of."""
    for parameter in model.parameters():
        grad = parameter.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if local is not None and local.numel():
            with torch.no_grad():
                local[(0,) * local.dim()] = float("nan")
            return
