"""What one optimizer step of a layout costs, in seconds on one device, estimated from the config
and the machine's stated rates: the figure the planner ranks the layouts that fit by.

Rates (``Rates``): the compute rate of one device (FLOP/s it achieves in the compute dtype, not
its datasheet peak) and the bandwidth one device has to the others of its host (``intra``) and
to other hosts (``inter``), each in bytes/s per device and direction. A collective runs at the
slowest link its group crosses: ``inter`` when the group has ranks on more than one host
(``layout.spans_hosts``), else ``intra``.

The terms (``Cost``), for one step of G tokens (the global batch) on W devices:
- compute: ``flops.flops_per_token`` x G / W / rate (fwd + bwd; the stages of a pipeline
  taken as balanced).
- recompute: with activation checkpointing the trainer recomputes each block's forward in
  backward (``parallelize``: ``checkpoint_wrapper`` per block): a third of the blocks' FLOPs
  (forward 2N, backward 4N), so the step's compute becomes ~4/3 of itself (the head is not
  recomputed).
- bubble: 1F1B with p stages and m micro-batches idles (p - 1) / (m + p - 1) of the pipeline's
  time, i.e. (compute + recompute) x (p - 1) / m; m is the micro-batches per data-parallel rank
  and step (the trainer's ``pp_microbatches`` default).
- comm: the bytes one device sends per step over its group's bandwidth. FSDP's traffic runs
  beside the compute (FSDP2 gathers the next block's weights and reduce-scatters the last
  block's gradients while a block computes), so only what exceeds compute + recompute is
  exposed; TP's, CP's, EP's and PP's traffic is counted whole (goodput's TP is not
  asynchronous; ring attention's overlap is left out). The figure ranks layouts; it does not
  predict a step. A ring all-gather or reduce-scatter of S bytes over n ranks sends
  (n - 1) / n x S from each, an all-reduce twice that, an all-to-all (n - 1) / n of its buffer.
  - FSDP (when the trainer applies it, ``fsdp_shards``): the stage's weights (P, this device's
    before sharding) gathered in the compute dtype a, the gradients reduce-scattered in the
    reduce dtype g. Without pp, twice per micro-batch (forward, and backward after
    ``reshard_after_forward``) and the reduce-scatter once a step (every micro-batch with
    ``sync_every_micro_batch``); under pp once per step each (the pipeline stage keeps them
    gathered through the step: torch's ``PipelineStage``). dp_replicate > 1 adds an all-reduce
    of the sharded gradients over the replicas.
  - TP (sequence parallel): per block 4 collectives of the micro-batch's activations (t tokens
    x d x a) forward, 4 backward, 4 more when recomputed; 4 for the embedding and the head.
  - CP: ring attention passes each rank's K and V (t x 2 kv / tp x a) cp - 1 times forward,
    K, V and their gradients backward, and once more when recomputed.
  - EP: each MoE layer's dispatch and combine all-to-alls (top_k x t x d x a) forward and
    backward, again when recomputed.
  - PP: each micro-batch's activations sent to the next stage and their gradients back (t x d
    x a / tp each way).

Does not: model latency, overlap, matmul efficiency at small shapes, or interleaved schedules.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from goodput.plan.layout import CACHED, Layout, context_tokens, spans_hosts
from goodput.plan.memory import Workload, stage_parameters, worst_stages
from goodput.train.config.model import ModelConfig
from goodput.train.config.parallel import fsdp_shards
from goodput.train.flops import flops_per_token

TP_COLLECTIVES_PER_BLOCK = 8  # all-gather and reduce-scatter before/after attention and MLP, x2
TP_COLLECTIVES_RECOMPUTED = 4  # the forward's, again
TP_COLLECTIVES_OUTER = 4  # the embedding's reduce-scatter and the head's all-gather, x2
_flops_per_token = functools.lru_cache(maxsize=CACHED)(flops_per_token)  # asked of every layout


@dataclass(frozen=True, slots=True, kw_only=True)
class Rates:
    """A device's compute rate and bandwidths (the module docstring)."""

    flops: float  # FLOP/s one device achieves
    intra_bytes: float  # bytes/s per device to a device of its host
    inter_bytes: float  # bytes/s per device to another host
    ppn: int  # devices per host


@dataclass(frozen=True, slots=True, kw_only=True)
class Cost:
    """Seconds per optimizer step on one device, by term (the module docstring)."""

    compute: float
    recompute: float
    bubble: float
    fsdp: float
    tp: float
    cp: float
    ep: float
    pp: float

    @property
    def fsdp_exposed(self) -> float:
        """What of FSDP's traffic the compute does not hide."""
        return max(0.0, self.fsdp - self.compute - self.recompute)

    @property
    def comm(self) -> float:
        """The exposed communication."""
        return self.fsdp_exposed + self.tp + self.cp + self.ep + self.pp

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.bubble + self.comm

    def seconds(self) -> dict[str, float]:
        return {
            **asdict(self),
            "fsdp_exposed": self.fsdp_exposed,
            "comm": self.comm,
            "total": self.total,
        }


def step_cost(model: ModelConfig, layout: Layout, work: Workload, rates: Rates) -> Cost:
    """The estimated seconds of one step of ``work`` in ``layout`` (the module docstring)."""
    tokens = work.global_batch_samples * work.seq_len
    compute = _flops_per_token(model, work.seq_len) * tokens / layout.product() / rates.flops
    recompute = 0.0
    if layout.activation_checkpointing:
        head = 6 * (model.vocab_size * model.dim + model.dim)  # the head and final norm, fwd+bwd
        blocks = _flops_per_token(model, work.seq_len) - head
        recompute = blocks / 3 * tokens / layout.product() / rates.flops
    micro = work.accumulation(layout)
    bubble = (compute + recompute) * (layout.pp - 1) / micro
    return Cost(
        compute=compute,
        recompute=recompute,
        bubble=bubble,
        fsdp=_fsdp(model, layout, work, rates),
        tp=_tp(model, layout, work, rates),
        cp=_cp(model, layout, work, rates),
        ep=_ep(model, layout, work, rates),
        pp=_pp(model, layout, work, rates),
    )


def _bandwidth(layout: Layout, group: str, rates: Rates) -> float:
    crosses = spans_hosts(layout, group, rates.ppn)
    return rates.inter_bytes if crosses else rates.intra_bytes


def _ring(ranks: int) -> float:
    """The share of a gathered tensor each rank sends in a ring all-gather or reduce-scatter."""
    return (ranks - 1) / ranks


def _tokens(layout: Layout, work: Workload) -> int:
    """Tokens of one micro-batch on one rank (the longest context-parallel share)."""
    return work.micro_batch_size * context_tokens(work.seq_len, layout.cp)


def _fsdp(model: ModelConfig, layout: Layout, work: Workload, rates: Rates) -> float:
    if not fsdp_shards(layout.dp_replicate * layout.shard, work.precision):
        return 0.0
    a, g = work.policy.compute_bytes, work.policy.reduce_bytes
    micro = work.accumulation(layout)
    part = max(
        (stage_parameters(model, layout, s) for s in worst_stages(model, layout)),
        key=lambda p: p.dense + p.experts,
    )
    if layout.pp > 1:
        gathers, reductions = 1, 1
    else:
        gathers, reductions = 2 * micro, micro if work.sync_every_micro_batch else 1
    moved = part.dense * _ring(layout.shard) + part.experts * _ring(layout.expert_shard)
    seconds = (gathers * a + reductions * g) * moved / _bandwidth(layout, "fsdp", rates)
    if layout.dp_replicate > 1:
        sharded = part.sharded(layout)
        all_reduce = 2 * _ring(layout.dp_replicate) * g * sharded * reductions
        seconds += all_reduce / _bandwidth(layout, "dp_replicate", rates)
    return seconds


def _tp(model: ModelConfig, layout: Layout, work: Workload, rates: Rates) -> float:
    if layout.tp == 1:
        return 0.0
    per_block = TP_COLLECTIVES_PER_BLOCK
    per_block += TP_COLLECTIVES_RECOMPUTED if layout.activation_checkpointing else 0
    layers = max(layout.stage_layers(model.num_layers))
    collectives = layers * per_block + TP_COLLECTIVES_OUTER
    size = _tokens(layout, work) * model.dim * work.policy.compute_bytes
    moved = collectives * _ring(layout.tp) * size * work.accumulation(layout)
    return moved / _bandwidth(layout, "tp", rates)


def _cp(model: ModelConfig, layout: Layout, work: Workload, rates: Rates) -> float:
    if layout.cp == 1:
        return 0.0
    passes = 3 + (1 if layout.activation_checkpointing else 0)  # fwd; K, V and grads bwd
    kv = 2 * model.kv_heads * model.head_dim / layout.tp * work.policy.compute_bytes
    per_layer = passes * (layout.cp - 1) * _tokens(layout, work) * kv
    layers = max(layout.stage_layers(model.num_layers))
    moved = per_layer * layers * work.accumulation(layout)
    return moved / _bandwidth(layout, "cp", rates)


def _ep(model: ModelConfig, layout: Layout, work: Workload, rates: Rates) -> float:
    if layout.ep == 1 or model.moe is None:
        return 0.0
    all_to_alls = 4 + (2 if layout.activation_checkpointing else 0)
    buffer = model.moe.top_k * _tokens(layout, work) * model.dim * work.policy.compute_bytes
    per_layer = all_to_alls * _ring(layout.ep) * buffer
    moved = per_layer * model.num_layers * work.accumulation(layout)
    return moved / _bandwidth(layout, "ep", rates)


def _pp(model: ModelConfig, layout: Layout, work: Workload, rates: Rates) -> float:
    if layout.pp == 1:
        return 0.0
    size = _tokens(layout, work) * model.dim * work.policy.compute_bytes / layout.tp
    return 2 * size * work.accumulation(layout) / _bandwidth(layout, "pp", rates)
