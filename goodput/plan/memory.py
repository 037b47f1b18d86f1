"""The memory one device needs to train a model in a layout, estimated from the config alone.

Bytes per device, for the worst pipeline stage (the largest stage's sum is the estimate).
Notation: P are parameter counts (``flops.model_size``); from the precision policy's table
(``goodput.train.config.precision``), B the state bytes per parameter (fp32-master 16 = fp32
weights 4 + fp32 gradients 4 + AdamW moments 8; pure-bf16 8; fp32 16), a the bytes of the
compute dtype (2 for bf16, 4 for fp32), g the bytes of a gradient as FSDP reduces it
(fp32-master 4, pure-bf16 2, fp32 4); d dim, h heads, kv = kv heads x head dim, e head dim, f
ffn dim, V vocabulary.

Where the parameters go. TP splits each block's matmul weights and the embedding and output
head (by vocabulary) by tp; the norms (and an MoE router) stay whole. PP gives each stage the
layers ``Layout.stage_layers`` says (``pp_layers_per_stage``, else the trainer's even split,
the first layers % pp stages one more); the embedding lives on the first stage, the final norm
and head on the last (a tied head is a copy there when pp > 1). A
pipeline rank holds ``Layout.rank_stages`` (one stage, or 2 and more under the interleaved and V
schedules: rank 0 holds the first and the last in a V). EP splits the routed experts by ep; an
MoE layer (router, shared and routed experts) is not split by tp. A stage's dense parameters
are FSDP-sharded over dp_shard x cp ranks, its experts over dp_shard / ep x cp; dp_replicate
replicates. Under tp an MoE layer's input is its rank's slice of the sequence, not gathered.

The terms (``Breakdown``):
- state = B x (dense / (dp_shard x cp) + experts / (dp_shard / ep)), each tensor's rows
  rounded up to whole rows per rank as FSDP splits them (``StageParameters.sharded``): the
  weights, gradients and optimizer state one device holds (``state_bytes_per_device``, which
  ``plan.verify`` compares with what the trainer builds).
- gathered: FSDP's unsharded weights in the compute dtype, a x P: without pp, the 2 largest
  blocks (the one computing and the one prefetched) plus the root unit (embedding, final norm,
  head), which FSDP2 keeps unsharded from forward to backward; with pp > 1, the whole stage
  (goodput turns off resharding after forward under pp, ``parallelize._fully_shard``). FSDP
  runs when there is more than one data-parallel rank, or for fp32-master on one.
- held_gradients: with FSDP, more than one micro-batch per step and
  ``sync_every_micro_batch = false`` (the default), FSDP keeps the unsharded gradients in the
  reduce dtype through the accumulation (torch's FSDP2 ``set_requires_gradient_sync(False)``);
  they stand in for the sharded ones: g x (unsharded - sharded) parameters. Under pp always
  (torch's ``PipelineStage`` reduces them at the last micro-batch's backward only).
- activations: what one block saves for backward, per token of a micro-batch, counted tensor
  by tensor for goodput's block (pre-norm RMSNorm, GQA attention through SDPA's flash kernel,
  which keeps the log-sum-exp and no t x t matrix, SwiGLU or top-k MoE); a test holds it to the
  bytes autograd really saves:
    norms, 2 x (4d + 4 + a d): the fp32 input, the inverse RMS, the normalised input;
    attention: a (2d + 2kv) + 4h: rotated q, k and v, the output, the fp32 log-sum-exp;
    dense MLP: 4 a f (gate, SiLU, up and their product);
    MoE: top_k x (3 a d + 4 a f_expert) for each routed copy of a token (its gathered input,
    the expert's output, the gated output; the expert's SwiGLU), 4 a f_expert for a shared
    expert, 8 x experts + (28 + a) x top_k for the router (fp32 logits and probabilities,
    indices, gates);
  all of those are split by tp (heads and ffn by the matmuls, the rest by sequence
  parallelism); not split: the two norm outputs that the matmuls save, gathered over the
  sequence (2 a d), and the rotary cos/sin (4e). Tokens: micro_batch x the longest cp rank's
  share of seq_len. With activation checkpointing (``Layout.activation_checkpointing``) a
  layer keeps, plus one layer's full activations while it is recomputed:
    "full" (whole blocks): only its input, a d / tp;
    "op" (the per-op policy, ``layer_op_bytes``): its input and the outputs of its matmuls and
    attention: a (d + q + 2kv + q) / tp + 4h / tp (input; q, k, v; attention's output and
    log-sum-exp), 2 a d for the outputs of wo and w2 (partial sums over the whole sequence
    before tp's reduce-scatter), the MLP's matmul outputs 2 a f / tp (MoE: top_k x (2 a
    f_expert + a d) and the shared expert's); the norms, rotary, SiLU and products recomputed;
    "budget": torch's memory budget b keeps full's + b x (none's - full's).
  Under pp, the schedule keeps ``schedule.in_flight`` micro-batches of a pipeline rank's
  layers in flight (1F1B: pp - r on rank r; no more than the micro-batches of a step).
- logits, on the last stage: micro_batch x tokens x (V (a + 4) / tp + (4d + 4 + a d) / tp + a d):
  the logits and the fp32 log-softmax that the loss keeps (both split by vocabulary under tp),
  the final norm's saved tensors, and the head's input, gathered over the sequence.
- fp8 (``Layout.fp8``) with tensorwise scaling gathers the blocks' linear weights in float8
  (torchao's float8 all-gather): 1 byte instead of a for those in ``gathered``. Not counted:
  fp8's scales and torch.compile's smaller saved set (torchtitan measured 77.0 against 82.4
  GiB for its 8B, benchmarks/llama3_h100_202412_torchtitan.md Table 1).
- runtime: a flat allowance of RUNTIME_FRACTION of the device for what is not derived: the
  CUDA/XPU context, communication buffers, the caching allocator's fragmentation, the
  gradients of activations in flight in backward, the optimizer step's temporaries.

Does not: allocate anything, memory taken by other processes, or the start-up of a fresh run
(which builds the whole model on every rank).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

from goodput.plan.layout import CACHED, Layout, context_tokens
from goodput.plan.schedule import in_flight
from goodput.train.config.model import ModelConfig
from goodput.train.config.parallel import fsdp_shards
from goodput.train.config.precision import PRECISIONS, PrecisionPolicy
from goodput.train.flops import model_size

GIB = 2**30
GATHERED_BLOCKS = 2  # the block being computed and the one FSDP prefetches
LOSS_BYTES = 4  # the fp32 log-softmax the loss keeps for each logit
RUNTIME_FRACTION = 0.10


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What one step asks, whatever the layout."""

    seq_len: int
    micro_batch_size: int
    global_batch_samples: int  # sequences per optimizer step, all ranks together
    precision: str = "fp32-master"  # a name of PRECISIONS
    sync_every_micro_batch: bool = False

    @property
    def policy(self) -> PrecisionPolicy:
        return PRECISIONS[self.precision]

    def accumulation(self, layout: Layout) -> int:
        """Micro-batches per data-parallel rank and step (at least 1)."""
        return max(1, self.global_batch_samples // (self.micro_batch_size * layout.dp))


@dataclass(frozen=True, slots=True)
class Parameters:
    """A model's parameter counts by where a layout puts them."""

    block_split: int  # per block: the matmul weights tp splits (attention; a dense MLP)
    block_whole: int  # per block: the norm gains, and an MoE's router and shared expert
    block_shared: int  # per block: the shared expert's weights (in block_whole)
    block_experts: int  # per block: the routed experts, split by ep
    embedding: int
    head: int  # the output head: a copy of the embedding when tied (held apart only under pp)
    final_norm: int
    tied: bool

    @classmethod
    def of(cls, model: ModelConfig) -> Parameters:
        size = model_size(model)
        head = 0 if model.tie_embeddings else model.vocab_size * model.dim
        blocks = size.total - size.embedding - head - model.dim
        assert blocks % model.num_layers == 0, "every block has the same parameters"
        block = blocks // model.num_layers
        moe = model.moe
        experts = moe.num_experts * 3 * model.dim * moe.expert_ffn_dim if moe else 0
        shared = 3 * model.dim * moe.expert_ffn_dim if moe and moe.shared_expert else 0
        # An MoE layer is replicated over the tensor-parallel ranks (each runs it on its own
        # slice of the sequence): its router and shared expert stay whole.
        whole = 2 * model.dim + (model.dim * moe.num_experts + shared if moe else 0)
        return cls(
            block_split=block - experts - whole,
            block_whole=whole,
            block_shared=shared,
            block_experts=experts,
            embedding=size.embedding,
            head=model.vocab_size * model.dim,
            final_norm=model.dim,
            tied=model.tie_embeddings,
        )


@functools.lru_cache(maxsize=CACHED)
def _parameters(model: ModelConfig) -> Parameters:
    return Parameters.of(model)


@dataclass(frozen=True, slots=True)
class Breakdown:
    """One device's memory, in bytes, on its layout's worst stage."""

    state: float
    gathered: float
    held_gradients: float
    activations: float
    logits: float
    runtime: float
    stage: int  # the pipeline rank these are for (0 without pp)

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "stage")

    def gib(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) / GIB for f in fields(self) if f.name != "stage"}


def layer_activation_bytes(model: ModelConfig, compute_bytes: int, tp: int) -> float:
    """Bytes one block saves for backward per token (the module docstring's count)."""
    a, d, h, e = compute_bytes, model.dim, model.num_heads, model.head_dim
    kv = model.kv_heads * e
    norms = 2 * (4 * d + 4 + a * d)
    attention = a * (2 * d + 2 * kv) + 4 * h
    if model.moe is None:
        mlp = 4 * a * model.mlp_dim
    else:
        moe, f = model.moe, model.moe.expert_ffn_dim
        mlp = moe.top_k * (3 * a * d + 4 * a * f) + 8 * moe.num_experts + (28 + a) * moe.top_k
        mlp += 4 * a * f if moe.shared_expert else 0
    return (norms + attention + mlp) / tp + _whole_sequence(model, a, tp) + 4 * e  # + rotary


def _whole_sequence(model: ModelConfig, compute_bytes: int, tp: int) -> float:
    """Bytes per token a block keeps over the whole sequence under tp (sequence parallelism
    gathers them): the input of attention's matmuls (their norm's output), and of a dense
    MLP's; an MoE layer runs on the rank's own slice of the sequence, its input split by tp.
    Under the per-op policy the same count is the partial sums of wo and a dense w2, before
    their reduce-scatter."""
    a, d = compute_bytes, model.dim
    return a * d + (a * d if model.moe is None else a * d / tp)


def layer_op_bytes(model: ModelConfig, compute_bytes: int, tp: int) -> float:
    """Bytes one block keeps per token under the per-op checkpointing policy (the module
    docstring's "op")."""
    a, d, h = compute_bytes, model.dim, model.num_heads
    q, kv = h * model.head_dim, model.kv_heads * model.head_dim
    attention = a * (d + 2 * q + 2 * kv) + 4 * h  # input; q, k, v; output and log-sum-exp
    if model.moe is None:
        mlp = 2 * a * model.mlp_dim
    else:
        f = model.moe.expert_ffn_dim
        mlp = model.moe.top_k * (2 * a * f + a * d) + (2 * a * f if model.moe.shared_expert else 0)
    return (attention + mlp) / tp + _whole_sequence(model, a, tp)


def kept_layer_bytes(model: ModelConfig, layout: Layout, compute_bytes: int) -> float:
    """Bytes one block keeps per token between its forward and backward under ``layout``'s
    activation checkpointing (the module docstring)."""
    tp = layout.tp
    none = layer_activation_bytes(model, compute_bytes, tp)
    full = compute_bytes * model.dim / tp
    mode = layout.activation_checkpointing
    if mode == "full":
        return full
    if mode == "op":
        return layer_op_bytes(model, compute_bytes, tp)
    if mode == "budget":
        return full + layout.activation_memory_budget * (none - full)
    return none


@dataclass(frozen=True, slots=True)
class StageParameters:
    """One device's parameters on a pipeline rank (all its stages), before FSDP shards them
    (TP and EP splits applied): ``dense`` shards over dp_shard x cp ranks, ``experts`` over
    dp_shard / ep x cp; ``block_*`` are one block's, ``root`` the embedding, final norm and
    head it holds."""

    dense: float
    experts: float
    moe_whole: float  # of ``dense``: the MoE layers' routers and shared experts
    block_dense: float
    block_experts: float
    root: float
    # (how many, dim-0 rows, elements per row, an expert tensor) of the tensors above
    tensors: tuple[tuple[int, int, int, bool], ...]

    def sharded(self, layout: Layout) -> float:
        """What the rank's fullest device keeps of them under FSDP, which splits each
        tensor's dim 0 as torch.chunk does: ceil(rows / ranks) rows on the first ranks (FSDP2
        pads every rank's shard to that), more than the average when ranks do not divide the
        rows (the 80B's 1024 kv rows over 372 ranks; 8 experts over 16)."""
        return sum(
            count * math.ceil(rows / (layout.expert_fsdp if expert else layout.shard)) * width
            for count, rows, width, expert in self.tensors
        )

    def moe_sharded(self, layout: Layout) -> float:
        """The MoE layers' parameters (router, shared and routed experts) one device keeps
        under FSDP: those replicated over the tensor-parallel ranks."""
        return self.moe_whole / layout.shard + self.experts / layout.expert_fsdp


def stage_parameters(model: ModelConfig, layout: Layout, pp_rank: int) -> StageParameters:
    """Pipeline rank ``pp_rank``'s parameters on one of its devices (the module docstring)."""
    split = layout.stage_layers(model.num_layers)
    return _stage_parameters(model, layout.tp, layout.ep, split, layout.rank_stages(pp_rank))


@functools.lru_cache(maxsize=CACHED)
def _stage_parameters(
    model: ModelConfig, tp: int, ep: int, split: tuple[int, ...], stages: tuple[int, ...]
) -> StageParameters:
    """``stage_parameters`` of a layout of ``tp``, ``ep`` and ``split`` (the layers of each
    stage) on the rank holding ``stages``: all it reads of the layout, so one computation
    serves every data-parallel split."""
    params = _parameters(model)
    layers = sum(split[s] for s in stages)
    first, last, pipelined = 0 in stages, len(split) - 1 in stages, len(split) > 1
    block_dense = params.block_split / tp + params.block_whole
    block_experts = params.block_experts / ep
    root = params.embedding / tp if first else 0.0
    if last:
        untied_or_copied = not params.tied or pipelined
        root += params.final_norm + (params.head / tp if untied_or_copied else 0.0)
    norms = 2 * model.dim
    return StageParameters(
        dense=layers * block_dense + root,
        experts=layers * block_experts,
        moe_whole=layers * (params.block_whole - norms),
        block_dense=block_dense,
        block_experts=block_experts,
        root=root,
        tensors=_stage_tensors(model, tp, ep, layers, first=first, last=last, pipelined=pipelined),
    )


def _stage_tensors(
    model: ModelConfig, tp: int, ep: int, layers: int, *, first: bool, last: bool, pipelined: bool
) -> tuple[tuple[int, int, int, bool], ...]:
    """The tensors of ``StageParameters.tensors``: the trainer's parameters, TP and EP splits
    applied (``plan.verify`` holds the sum to what the trainer builds)."""
    d, moe = model.dim, model.moe
    q, kv = model.num_heads * model.head_dim // tp, model.kv_heads * model.head_dim // tp
    block = [(d, 1), (d, 1), (q, d), (kv, d), (kv, d), (d, q)]  # norms, wq, wk, wv, wo
    experts = []
    if moe is None:
        f = model.mlp_dim // tp
        block += [(f, d), (f, d), (d, f)]  # w1, w3, w2
    else:  # replicated over tp: none of it split
        f = moe.expert_ffn_dim
        block.append((moe.num_experts, d))  # the router
        block += [(f, d), (f, d), (d, f)] if moe.shared_expert else []
        experts = [(moe.num_experts // ep, d * f)] * 3  # w1, w3, w2 stacked by expert
    root = [(model.vocab_size // tp, d)] if first else []
    if last:
        root.append((d, 1))
        root += [(model.vocab_size // tp, d)] if not model.tie_embeddings or pipelined else []
    return (
        *((layers, rows, width, False) for rows, width in block),
        *((layers, rows, width, True) for rows, width in experts),
        *((1, rows, width, False) for rows, width in root),
    )


def state_bytes_per_device(
    model: ModelConfig, layout: Layout, precision: str, pp_rank: int | None = None
) -> float:
    """The weights, gradients and optimizer state one device holds, in bytes: on pipeline
    rank ``pp_rank``, or (None) on the rank holding the most. B x the device's FSDP shard of
    its stages' parameters (B: the policy's ``bytes_per_parameter``); activations,
    gathered weights and buffers are not state."""
    ranks = worst_ranks(model, layout) if pp_rank is None else (pp_rank,)
    sharded = max(stage_parameters(model, layout, r).sharded(layout) for r in ranks)
    return PRECISIONS[precision].bytes_per_parameter * sharded


def estimate(model: ModelConfig, layout: Layout, work: Workload, device_bytes: float) -> Breakdown:
    """The per-device memory of ``layout``: the largest over its pipeline ranks."""
    return max(
        (_stage(model, layout, work, device_bytes, r) for r in worst_ranks(model, layout)),
        key=lambda breakdown: breakdown.total,
    )


def worst_ranks(model: ModelConfig, layout: Layout) -> tuple[int, ...]:
    """The pipeline ranks that can hold the most: those holding the first stage (the
    embedding, the most micro-batches in flight) and the last (the head and the logits), and
    the earliest of the others with the most layers; any other rank has no more layers (so no
    more parameters) and no more micro-batches in flight than that one (every schedule keeps
    as many or fewer on a later rank: ``schedule.in_flight``)."""
    split = layout.stage_layers(model.num_layers)
    return _worst_ranks(split, tuple(layout.rank_stages(r) for r in range(layout.pp)))


@functools.lru_cache(maxsize=CACHED)
def _worst_ranks(split: tuple[int, ...], stages: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    ends = {0, len(split) - 1}
    worst = {r for r, held in enumerate(stages) if ends & set(held)}
    middle = [r for r in range(len(stages)) if r not in worst]
    if middle:
        worst.add(max(middle, key=lambda r: (sum(split[s] for s in stages[r]), -r)))
    return tuple(sorted(worst))


def _stage(
    model: ModelConfig, layout: Layout, work: Workload, device_bytes: float, pp_rank: int
) -> Breakdown:
    part = stage_parameters(model, layout, pp_rank)
    a = work.policy.compute_bytes
    stages = layout.rank_stages(pp_rank)
    split = layout.stage_layers(model.num_layers)
    layers = sum(split[s] for s in stages)
    tp, last = layout.tp, len(split) - 1 in stages
    dense, experts, sharded = part.dense, part.experts, part.sharded(layout)
    block_dense, block_experts, root = part.block_dense, part.block_experts, part.root

    state = work.policy.bytes_per_parameter * sharded
    gathered = held = 0.0
    accumulation = work.accumulation(layout)
    if fsdp_shards(layout.dp_replicate * layout.shard, work.precision):
        # fp8 tensorwise gathers the blocks' linear weights in one byte each.
        linear = 1 if layout.fp8 == "tensorwise" else a
        blocks = linear * block_dense + a * block_experts
        if layout.pp > 1:
            gathered = layers * blocks + a * root
        else:
            gathered = min(GATHERED_BLOCKS, layers) * blocks + a * root
        # A pipeline stage holds them through the step whatever sync_every_micro_batch says
        # (torch's PipelineStage defers the reduction to the last micro-batch's backward).
        if accumulation > 1 and (layout.pp > 1 or not work.sync_every_micro_batch):
            held = work.policy.reduce_bytes * (dense + experts - sharded)

    tokens = work.micro_batch_size * context_tokens(work.seq_len, layout.cp)
    per_layer = layer_activation_bytes(model, a, tp)
    flight = 1.0
    if layout.pp > 1:
        flight = in_flight(
            layout.pp_schedule, layout.pp, layout.stages_per_rank, accumulation, pp_rank
        )
    kept = flight * layers * kept_layer_bytes(model, layout, a)
    if layout.activation_checkpointing != "none":
        kept += per_layer  # the layer being recomputed
    activations = tokens * kept
    logits = 0.0
    if last:
        d = model.dim
        vocab = model.vocab_size * (a + LOSS_BYTES) / tp
        logits = tokens * (vocab + (4 * d + 4 + a * d) / tp + a * d)
    return Breakdown(
        state=state,
        gathered=gathered,
        held_gradients=held,
        activations=activations,
        logits=logits,
        runtime=RUNTIME_FRACTION * device_bytes,
        stage=pp_rank,
    )
