"""What one optimizer step of a layout costs, in seconds on one device, estimated from the config
and the machine's stated rates: the figure the planner ranks the layouts that fit by.

Rates (``Rates``): the compute rate of one device (FLOP/s it achieves in the compute dtype,
eager, not its datasheet peak), the bandwidth one device has to the others of its host
(``intra``) and to other hosts (``inter``), each in bytes/s per device and direction, and the
speed-ups of fp8 matmuls (per scaling; None where the device has no FP8) and of torch.compile
(``plan.calibration``'s devices carry fitted ones, with their sources). A collective runs at the
slowest link its group crosses: ``inter`` when the group has ranks on more than one host
(``layout.spans_hosts``), else ``intra``.

The terms (``Cost``), for one step of G tokens (the global batch) on W devices:
- compute: ``flops.flops_per_token`` x G / W / rate (fwd + bwd; the stages of a pipeline
  taken as balanced). With fp8 the blocks' linear layers (6 x their matmul weights a token;
  not the head, not routed experts: torchao's float8 linears as torchtitan converts them) run
  at ``fp8 speed-up`` x rate; with compile the whole step at ``compile`` x rate.
- recompute (``Layout.activation_checkpointing``): "full" recomputes each block's forward in
  backward (``checkpoint_wrapper`` per block): a third of the blocks' compute (forward 2N,
  backward 4N; the head is not recomputed). "op" recomputes only what the per-op policy does
  not save, the norms, rotary, SiLU and the products: ``ELEMENTWISE_SHARE`` of the blocks'
  forward. "budget" b: between them, linearly in the memory kept (``memory.kept_layer_bytes``)
  from full's recompute at full's memory through op's at op's to none at none's (torch's
  min-cut recomputes the cheapest bytes first).
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
  - FSDP with fp8 tensorwise: the blocks' linear weights gathered in float8, 1 byte each.
  - TP (sequence parallel): per block 4 collectives of the micro-batch's activations (t tokens
    x d x a) forward, 4 backward, 4 more when whole blocks are recomputed (2, the all-gathers
    of the norms' outputs, under "op" and a budget above op's memory); 4 for the embedding
    and the head.
  - CP: ring attention passes each rank's K and V (t x 2 kv / tp x a) cp - 1 times forward,
    K, V and their gradients backward, and once more when whole blocks are recomputed ("op"
    saves attention's output).
  - EP: each MoE layer's dispatch and combine all-to-alls (top_k x t x d x a) forward and
    backward, again when whole blocks are recomputed (the dispatch only under "op").
  - PP: each micro-batch's activations sent to the next stage and their gradients back (t x d
    x a / tp each way).

Does not: model latency, overlap, matmul efficiency at small shapes, or interleaved schedules.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

from goodput.plan.layout import CACHED, Layout, context_tokens, spans_hosts
from goodput.plan.memory import (
    Parameters,
    Workload,
    kept_layer_bytes,
    layer_activation_bytes,
    stage_parameters,
    worst_ranks,
)
from goodput.plan.schedule import bubble
from goodput.train.config.model import ModelConfig
from goodput.train.config.parallel import fsdp_shards
from goodput.train.flops import flops_per_token

TP_COLLECTIVES_PER_BLOCK = 8  # all-gather and reduce-scatter before/after attention and MLP, x2
TP_COLLECTIVES_RECOMPUTED = 4  # the forward's, again
TP_GATHERS_RECOMPUTED = 2  # under "op": the all-gathers of the norms' outputs, again
TP_COLLECTIVES_OUTER = 4  # the embedding's reduce-scatter and the head's all-gather, x2
# The share of a block's forward time the per-op policy recomputes: its elementwise ops (two
# RMSNorms, rotary, SiLU and the gate's product, the residual adds) move ~36 d + 6 f bytes a
# token in bf16 against ~24 d^2 + 6 d f FLOPs of matmuls (Llama 3 8B: 0.23 MB against 0.44
# GFLOP): at an H100's 3.35 TB/s and 989 TFLOP/s peaks, and the ~50% of them that each
# reaches, about a tenth of the forward.
ELEMENTWISE_SHARE = 0.1
_flops_per_token = functools.lru_cache(maxsize=CACHED)(flops_per_token)  # asked of every layout
_parameters = functools.lru_cache(maxsize=CACHED)(Parameters.of)


@dataclass(frozen=True, slots=True, kw_only=True)
class Rates:
    """A device's compute rate and bandwidths (the module docstring)."""

    flops: float  # FLOP/s one device achieves, eager, in the compute dtype
    intra_bytes: float  # bytes/s per device to a device of its host
    inter_bytes: float  # bytes/s per device to another host
    ppn: int  # devices per host
    fp8_rowwise: float | None = None  # the linear layers' speed-up in fp8; None: no FP8
    fp8_tensorwise: float | None = None
    compile: float = 1.0  # the step's speed-up under torch.compile
    gemm_half_dim: float = 0.0  # the model dim at which the matmuls reach half ``flops``

    def fp8(self, recipe: str) -> float | None:
        """The linear layers' speed-up under fp8 ``recipe`` (None: the device has no FP8)."""
        return self.fp8_rowwise if recipe == "rowwise" else self.fp8_tensorwise


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
    rate = rates.flops * (rates.compile if layout.compile else 1.0)
    rate *= model.dim / (model.dim + rates.gemm_half_dim)
    seconds = tokens / layout.product() / rate  # per FLOP of a token
    flops = _flops_per_token(model, work.seq_len)
    head = 6 * (model.vocab_size * model.dim + model.dim)  # the head and final norm, fwd+bwd
    blocks: float = flops - head
    if layout.fp8 is not None:
        speedup = rates.fp8(layout.fp8)
        assert speedup is not None, "the ladder offers fp8 only on a device that has it"
        params = _parameters(model)
        linear = 6 * model.num_layers * (params.block_split + params.block_shared)
        blocks -= linear * (1 - 1 / speedup)
    compute = (head + blocks) * seconds
    recompute = blocks / 3 * seconds * _recomputed_share(model, layout, work)
    idle = 0.0
    if layout.pp > 1:
        third = compute / 3  # forward, input backward, weight backward (schedule.py)
        idle = bubble(
            layout.pp_schedule,
            layout.pp,
            layout.stages_per_rank,
            work.accumulation(layout),
            forward=third,
            backward_input=third + recompute,
            backward_weight=third,
        )
    return Cost(
        compute=compute,
        recompute=recompute,
        bubble=idle,
        fsdp=_fsdp(model, layout, work, rates),
        tp=_tp(model, layout, work, rates),
        cp=_cp(model, layout, work, rates),
        ep=_ep(model, layout, work, rates),
        pp=_pp(model, layout, work, rates),
    )


def _recomputed_share(model: ModelConfig, layout: Layout, work: Workload) -> float:
    """The share of the blocks' forward that ``layout``'s checkpointing recomputes (the module
    docstring)."""
    mode = layout.activation_checkpointing
    if mode in ("none", "full", "op"):
        return {"none": 0.0, "full": 1.0, "op": ELEMENTWISE_SHARE}[mode]
    a = work.policy.compute_bytes
    none = layer_activation_bytes(model, a, layout.tp)
    full = a * model.dim / layout.tp
    op = kept_layer_bytes(model, replace(layout, activation_checkpointing="op"), a)
    kept = kept_layer_bytes(model, layout, a)
    if kept >= op:
        return ELEMENTWISE_SHARE * (none - kept) / (none - op)
    return ELEMENTWISE_SHARE + (1 - ELEMENTWISE_SHARE) * (op - kept) / (op - full)


def _whole_blocks_recomputed(model: ModelConfig, layout: Layout, work: Workload) -> bool:
    """Whether the recompute runs the blocks' collectives again (whole blocks: "full", or a
    budget below the per-op policy's memory)."""
    if layout.activation_checkpointing != "budget":
        return layout.activation_checkpointing == "full"
    a = work.policy.compute_bytes
    op = kept_layer_bytes(model, replace(layout, activation_checkpointing="op"), a)
    return kept_layer_bytes(model, layout, a) < op


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
        (stage_parameters(model, layout, s) for s in worst_ranks(model, layout)),
        key=lambda p: p.dense + p.experts,
    )
    if layout.pp > 1:
        gathers, reductions = 1, 1
    else:
        gathers, reductions = 2 * micro, micro if work.sync_every_micro_batch else 1
    dense = part.dense * _ring(layout.shard)
    moved = dense + part.experts * _ring(layout.expert_fsdp)
    gathered = a * moved
    if layout.fp8 == "tensorwise":  # the blocks' linear weights gathered in one byte each
        gathered -= (a - 1) * (part.dense - part.root) * _ring(layout.shard)
    seconds = (gathers * gathered + reductions * g * moved) / _bandwidth(layout, "fsdp", rates)
    if layout.dp_replicate > 1:
        sharded = part.sharded(layout)
        all_reduce = 2 * _ring(layout.dp_replicate) * g * sharded * reductions
        seconds += all_reduce / _bandwidth(layout, "dp_replicate", rates)
    return seconds


def _tp(model: ModelConfig, layout: Layout, work: Workload, rates: Rates) -> float:
    if layout.tp == 1:
        return 0.0
    moe = model.moe is not None
    # An MoE layer runs on the rank's own slice of the sequence: only attention's collectives
    # (and the recompute's share of them) remain in its block.
    per_block = TP_COLLECTIVES_PER_BLOCK // (2 if moe else 1)
    if _whole_blocks_recomputed(model, layout, work):
        per_block += TP_COLLECTIVES_RECOMPUTED // (2 if moe else 1)
    elif layout.activation_checkpointing != "none":
        per_block += TP_GATHERS_RECOMPUTED // (2 if moe else 1)
    layers = _rank_layers(model, layout)
    collectives = layers * per_block + TP_COLLECTIVES_OUTER
    tokens = _tokens(layout, work)
    moved = collectives * _ring(layout.tp) * tokens * model.dim * work.policy.compute_bytes
    if model.moe is not None:  # each MoE layer gathers its top-k choices (int64) over cp x tp
        moved += layers * _ring(layout.cp * layout.tp) * tokens * model.moe.top_k * 8
    seconds = moved * work.accumulation(layout) / _bandwidth(layout, "tp", rates)
    if model.moe is not None:  # the MoE layers' gradients, replicated over tp, summed over it
        moe_params = max(
            stage_parameters(model, layout, r).moe_sharded(layout)
            for r in worst_ranks(model, layout)
        )
        reduced = 2 * _ring(layout.tp) * work.policy.reduce_bytes * moe_params
        seconds += reduced / _bandwidth(layout, "tp", rates)
    return seconds


def _rank_layers(model: ModelConfig, layout: Layout) -> int:
    """The most layers a pipeline rank holds (all its stages)."""
    split = layout.stage_layers(model.num_layers)
    return max(sum(split[s] for s in layout.rank_stages(r)) for r in range(layout.pp))


def _cp(model: ModelConfig, layout: Layout, work: Workload, rates: Rates) -> float:
    if layout.cp == 1:
        return 0.0
    passes = 3 + (1 if _whole_blocks_recomputed(model, layout, work) else 0)  # fwd; K, V, grads bwd
    kv = 2 * model.kv_heads * model.head_dim / layout.tp * work.policy.compute_bytes
    per_layer = passes * (layout.cp - 1) * _tokens(layout, work) * kv
    layers = _rank_layers(model, layout)
    moved = per_layer * layers * work.accumulation(layout)
    return moved / _bandwidth(layout, "cp", rates)


def _ep(model: ModelConfig, layout: Layout, work: Workload, rates: Rates) -> float:
    if layout.ep == 1 or model.moe is None:
        return 0.0
    all_to_alls = 4
    if _whole_blocks_recomputed(model, layout, work):
        all_to_alls += 2
    elif layout.activation_checkpointing != "none":
        all_to_alls += 1  # the dispatch: the experts' inputs are not saved
    # Each tp rank dispatches its own slice of the sequence.
    tokens = _tokens(layout, work) / layout.tp
    buffer = model.moe.top_k * tokens * model.dim * work.policy.compute_bytes
    per_layer = all_to_alls * _ring(layout.ep) * buffer
    moved = per_layer * _rank_layers(model, layout) * work.accumulation(layout)
    return moved / _bandwidth(layout, "ep", rates)


def _pp(model: ModelConfig, layout: Layout, work: Workload, rates: Rates) -> float:
    if layout.pp == 1:
        return 0.0
    size = _tokens(layout, work) * model.dim * work.policy.compute_bytes / layout.tp
    # Each of a rank's stages sends its micro-batch on (and the gradients back).
    sends = 2 * layout.stages_per_rank
    return sends * size * work.accumulation(layout) / _bandwidth(layout, "pp", rates)
