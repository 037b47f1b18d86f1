"""Pipeline parallelism: the model cut into stages by layer, run by a
``torch.distributed.pipelining`` schedule.

Stages. ``pp x stages_per_rank`` stages, placed as the schedule needs (``rank_stages``): stage
``s`` on pipeline rank ``s mod pp`` (looped, so under the interleaved schedules each rank's stages
are spread through the model), or under a V schedule (``zbv``, ``dualpipev``) stages ``r`` and
``2 pp - 1 - r`` on rank ``r``, the first and the last stage on rank 0. The layers split
evenly, the first stages taking one more where they do not divide, or as
``pp_layers_per_stage`` says. The first stage holds the embedding, the last the final norm and
the output head. Each stage is a ``Transformer`` that keeps only its parts, under their
whole-model names (checkpoints load across layouts by name), and ``parallelize`` lays it out
(TP, checkpointing, compile, FSDP over its data-parallel ranks) as a model of its own.

Init. The whole model is built on the meta device and cut there; each rank allocates only its
own stages, which ``goodput.train.init`` fills with the values one process draws for them.

Tied embeddings. In the whole model the embedding and the output head are one weight; here the
first stage holds it as ``embedding.weight`` and the last a copy as ``output.weight``, equal at
init. Their gradients are summed before clipping (between the two ranks that hold them, or on
rank 0 where a V holds both), so both take the same steps and stay equal; the copy is left out
of the gradient norm, which counts the one weight once, as one process does.

The loss. On the last stage the schedule calls ``loss_fn`` once per micro-batch: the summed
token loss over the step's global token count, the objective of ``step.forward_backward``; the
schedule must not scale the gradients by the number of micro-batches (``scale_grads=False``),
since the global count already did. The summed loss reaches every rank by a sum over the
pipeline (other stages add 0) and the data-parallel group, so the logged loss and the skip
decision are the same everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.microbatch import _Replicate
from torch.distributed.pipelining.schedules import (
    OVERLAP_F_B,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    _Action,
    _PipelineScheduleRuntime,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from goodput.beacon import current
from goodput.errors import GoodputError
from goodput.train.config.model import ModelConfig
from goodput.train.config.parallel import (
    SCHEDULE_PLACEMENT,
    ParallelConfig,
    even_layer_split,
    rank_stages,
)
from goodput.train.dtensors import local_tensor
from goodput.train.loss import labels_from_model, row_loss_sums, token_loss_sum
from goodput.train.model import Transformer
from goodput.train.parallel.mesh import ParallelMesh
from goodput.train.parallel.parallelize import parallelize
from goodput.train.ring_attention import ContextLayout

SCHEDULES: dict[str, type[PipelineScheduleSingle | PipelineScheduleMulti]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def layers_per_stage(cfg: ParallelConfig, num_layers: int) -> list[int]:
    """How many layers each stage runs, in stage order."""
    if cfg.pp_layers_per_stage is not None:
        return list(cfg.pp_layers_per_stage)
    return even_layer_split(num_layers, cfg.num_stages)


def cut_stage(whole: Transformer, layers: range, *, last: bool) -> Transformer:
    """A stage holding ``whole``'s layers ``layers`` (and the embedding when they start at 0,
    the head when ``last``), sharing their parameters with ``whole``."""
    cfg = whole.cfg
    with torch.device("meta"):
        stage = Transformer(cfg)
    stage.embedding = whole.embedding if layers.start == 0 else None
    stage.blocks = nn.ModuleDict({str(layer): whole.blocks[str(layer)] for layer in layers})
    stage.norm = whole.norm if last else None
    stage.output = whole.output if last else None
    if last and cfg.tie_embeddings and stage.embedding is None:
        assert whole.output is not None
        stage.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, device="meta")
        stage.output.weight = nn.Parameter(whole.output.weight.detach().clone())
    return stage


@dataclass(slots=True)
class StepLoss:
    """The schedule's ``loss_fn``: a micro-batch's summed token loss over the running step's
    global token count; it keeps the sums, for the logged loss."""

    global_tokens: int = 1
    micro_loss_sums: list[torch.Tensor] = field(default_factory=list)
    sample_labels: torch.Generator | None = None  # step.forward_backward's, for this step
    row_sums: list[torch.Tensor] | None = None  # each row's summed loss, while evaluating

    def __call__(self, logits_btv: torch.Tensor, labels_bt: torch.Tensor) -> torch.Tensor:
        if self.row_sums is not None:  # an evaluation (``Pipeline.row_loss_sums``)
            self.row_sums.append(row_loss_sums(logits_btv, labels_bt))
            return self.row_sums[-1].sum()
        if self.sample_labels is not None:
            labels_bt = labels_from_model(logits_btv, labels_bt, self.sample_labels)
        micro_loss_sum = token_loss_sum(logits_btv, labels_bt)
        self.micro_loss_sums.append(local_tensor(micro_loss_sum.detach()))
        return micro_loss_sum / self.global_tokens


@dataclass(slots=True)
class Pipeline:
    """This rank's stages and the schedule that runs them (see the module docstring)."""

    parts: list[Transformer]  # this rank's stages, in stage order
    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    has_first: bool
    has_last: bool
    pp_group: dist.ProcessGroup
    tie_group: dist.ProcessGroup | None  # the two ranks holding the tied weight, if this is one
    loss_parallel: bool  # the last stage's logits are vocabulary shards
    step_loss: StepLoss
    num_microbatches: int
    # Context parallelism: the positions of this rank's tokens in their sequences, which every
    # stage's attention needs (None: 0..t-1).
    positions_t: torch.Tensor | None = None

    @property
    def tied_copy(self) -> torch.Tensor | None:
        """The last stage's copy of a tied weight, which the gradient norm leaves out."""
        last = self.parts[-1]
        if self.has_last and last.cfg.tie_embeddings and last.embedding is None:
            assert last.output is not None
            return last.output.weight
        return None

    def forward_backward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        global_tokens: int,
        sample_labels: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Run one step's schedule over this rank's local batch; return the summed token loss
        of this rank's data-parallel share (0 off the last stage). ``sample_labels``: as for
        ``step.forward_backward``."""
        self.step_loss.global_tokens = global_tokens
        self.step_loss.micro_loss_sums = []
        self.step_loss.sample_labels = sample_labels
        args = (input_ids,) if self.has_first else ()
        target = labels if self.has_last else None
        context = loss_parallel() if self.loss_parallel else contextlib.nullcontext()
        with context:
            self.schedule.step(*args, target=target, **self._positions())
        loss_sum = torch.zeros((), device=labels.device)
        # The first step's schedule first runs a forward and backward of its own to learn the
        # shapes between stages (torch 2.13), calling loss_fn for it too: the step's own calls
        # are the last ones, one per micro-batch.
        for micro_loss_sum in self.step_loss.micro_loss_sums[-self.num_microbatches :]:
            loss_sum += micro_loss_sum
        with current().collective("step.pp"):
            dist.all_reduce(loss_sum, group=self.pp_group)
        if self.tie_group is not None or self.has_first and self.tied_copy is not None:
            self._sum_tied_gradients()
        return loss_sum

    def row_loss_sums(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward only, through the schedule: each row's summed token loss (``[b]``, fp32),
        on every stage of the pipeline. The batch must be shaped as the step's (the schedule
        fixed its micro-batches' shapes at the first step)."""
        self.step_loss.row_sums = []
        self.step_loss.sample_labels = None
        args = (input_ids,) if self.has_first else ()
        target = labels if self.has_last else None
        context = loss_parallel() if self.loss_parallel else contextlib.nullcontext()
        try:
            with torch.no_grad(), context, _forwards_only(self.schedule):
                self.schedule.eval(*args, target=target, **self._positions())
            rows = (
                torch.cat(self.step_loss.row_sums[-self.num_microbatches :])
                if self.has_last
                else torch.zeros(len(labels), device=labels.device)
            )
        finally:
            self.step_loss.row_sums = None
        with current().collective("eval.sums"):
            dist.all_reduce(rows, group=self.pp_group)
        return rows

    def _positions(self) -> dict[str, Any]:
        """The keyword arguments every stage's forward takes, each micro-batch alike."""
        return {} if self.positions_t is None else {"positions_t": self.positions_t}

    def _sum_tied_gradients(self) -> None:
        """Sum the gradients of the tied weight's two copies: between the two ranks that hold
        them, or on this rank where a V placed both."""
        weights = [self.parts[0].embedding.weight] if self.has_first else []  # type: ignore[union-attr]
        weights += [self.tied_copy] if self.tied_copy is not None else []
        grads = [_grad_laid_out_as(weight) for weight in weights]
        if any(grad is None for grad in grads):
            return
        shards = [local_tensor(grad) for grad in grads]  # type: ignore[arg-type]
        if len(shards) == 2:
            shards[0].add_(shards[1])
            shards[1].copy_(shards[0])
            return
        with current().collective("step.pp"):
            dist.all_reduce(shards[0], group=self.tie_group)


# The actions of a schedule's plan (torch's ``_ComputationType``) that compute or pass gradients.
BACKWARD_ACTIONS = frozenset(("B", "I", "W", "SEND_B", "RECV_B"))


@contextlib.contextmanager
def _forwards_only(schedule: PipelineScheduleSingle | PipelineScheduleMulti) -> Iterator[None]:
    """Run a multi-stage schedule's plan without its backward actions. Under ``eval`` torch 2.13
    skips a backward action's compute, but not a V schedule's hand-off of the gradient between a
    rank's two adjacent stages, which asserts a backward ("can't steal_bwd_input if this stage
    doesn't have backward"). The forwards keep their order, which cannot deadlock where the whole
    plan did not: leaving actions out only removes waits."""
    if not isinstance(schedule, _PipelineScheduleRuntime):
        yield
        return
    plan = schedule.pipeline_order_with_comms
    assert plan is not None  # built by the schedule's constructor
    schedule.pipeline_order_with_comms = {
        rank: [part for action in actions for part in _forward_parts(action)]
        for rank, actions in plan.items()
    }
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = plan


def _forward_parts(action: _Action) -> list[_Action]:
    """``action`` unless it is a backward one; of an overlapped forward and backward
    (DualPipeV's), the forward."""
    if action.computation_type == OVERLAP_F_B:
        return [part for sub in action.sub_actions or () for part in _forward_parts(sub)]
    return [] if action.computation_type.value in BACKWARD_ACTIONS else [action]


def _grad_laid_out_as(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight``'s gradient, laid out as the weight, so that the two copies' gradients sum shard
    by shard: a tensor-parallel embedding's comes back replicated, its weight's split by rows."""
    grad = weight.grad
    if (
        isinstance(grad, DTensor)
        and isinstance(weight, DTensor)
        and grad.placements != weight.placements
    ):
        grad = grad.redistribute(weight.device_mesh, weight.placements)
        weight.grad = grad
    return grad


def build_pipeline(
    model_cfg: ModelConfig,
    cfg: ParallelConfig,
    mesh: ParallelMesh,
    device: torch.device,
    *,
    num_microbatches: int,
    context: ContextLayout | None = None,
) -> Pipeline:
    """Collective: this rank's stages, parallelized and allocated on ``device`` but not
    initialised (``goodput.train.init`` fills them), and their schedule. ``context``: how
    context parallelism splits the training sequences (needed when ``cp`` > 1)."""
    with torch.device("meta"):
        whole = Transformer(model_cfg)
    counts = layers_per_stage(cfg, model_cfg.num_layers)
    starts = [sum(counts[:stage]) for stage in range(len(counts))]
    own = rank_stages(cfg.pp_schedule, cfg.pp, cfg.stages_per_rank, mesh.pp_rank)
    parts = []
    for stage in own:
        layers = range(starts[stage], starts[stage] + counts[stage])
        part = cut_stage(whole, layers, last=stage == cfg.num_stages - 1)
        parallelize(part, cfg, mesh, context=context)
        part.allocate(device)
        parts.append(part)
    stages = [
        PipelineStage(part, stage, cfg.num_stages, device, group=mesh.pp_group)
        for part, stage in zip(parts, own, strict=True)
    ]
    step_loss = StepLoss()
    positions_t = context.positions(mesh.cp_rank).to(device) if context is not None else None
    schedule = _schedule(
        cfg, stages, num_microbatches, step_loss, positions=positions_t is not None
    )
    # A V places the first and the last stage on one rank, which sums their gradients itself.
    tied_across_ranks = model_cfg.tie_embeddings and SCHEDULE_PLACEMENT[cfg.pp_schedule] != "v"
    tie_group = _tie_group(mesh) if tied_across_ranks else None
    return Pipeline(
        parts,
        schedule,
        has_first=0 in own,
        has_last=cfg.num_stages - 1 in own,
        pp_group=mesh.pp_group,
        tie_group=tie_group,
        loss_parallel=cfg.loss_parallel and mesh.degrees.tp > 1,
        step_loss=step_loss,
        num_microbatches=num_microbatches,
        positions_t=positions_t,
    )


def _schedule(
    cfg: ParallelConfig,
    stages: Sequence[PipelineStage],
    num_microbatches: int,
    step_loss: StepLoss,
    *,
    positions: bool,
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    # The positions go whole to every micro-batch (torch's spec for an argument not split).
    # (torch's annotation names TensorChunkSpec only; its splitter takes _Replicate too.)
    kwargs_chunk_spec: Any = {"positions_t": _Replicate()} if positions else None
    schedule = SCHEDULES[cfg.pp_schedule]
    try:
        if issubclass(schedule, PipelineScheduleSingle):
            (stage,) = stages
            return schedule(
                stage,
                num_microbatches,
                loss_fn=step_loss,
                scale_grads=False,
                kwargs_chunk_spec=kwargs_chunk_spec,
            )
        return schedule(
            list(stages),
            num_microbatches,
            loss_fn=step_loss,
            scale_grads=False,
            kwargs_chunk_spec=kwargs_chunk_spec,
        )
    except ValueError as exc:
        raise GoodputError.usage(
            "[parallel]",
            f"pp_schedule '{cfg.pp_schedule}' with {num_microbatches} micro-batches on pp = "
            f"{cfg.pp}: {exc}",
            "set parallel.pp_microbatches to a multiple of pp (and at least pp)",
        ) from None


def _tie_group(mesh: ParallelMesh) -> dist.ProcessGroup | None:
    """Collective: the pairs (first stage, last stage) of ranks at the same data- and
    tensor-parallel coordinates; this rank's pair, or None for a middle stage."""
    ranks = mesh.device_mesh.mesh  # pp x dp_replicate x dp_shard x tp
    pairs = [[int(a), int(b)] for a, b in zip(ranks[0].flatten(), ranks[-1].flatten(), strict=True)]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def model_parts(model: nn.Module | Pipeline) -> list[nn.Module]:
    """The modules a rank holds: its pipeline stages, or the whole model."""
    return list(model.parts) if isinstance(model, Pipeline) else [model]
