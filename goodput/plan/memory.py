"""The memory one device needs to train a model in a layout, estimated from the config alone.

Bytes per device, for the worst pipeline stage (the largest stage's sum is the estimate).
Notation: P are parameter counts (``flops.model_size``), B the state bytes per
parameter of the precision policy (``flops.BYTES_PER_PARAMETER``: fp32-master 16 = fp32 weights
4 + fp32 gradients 4 + AdamW moments 8; pure-bf16 8; fp32 16), a the bytes of the compute dtype
(2 for bf16, 4 for fp32), g the bytes of a gradient as FSDP reduces it (fp32-master 4, pure-bf16
2, fp32 4); d dim, h heads, kv = kv heads x head dim, e head dim, f ffn dim, V vocabulary.

Where the parameters go. TP splits each block's matmul weights and the embedding and output
head (by vocabulary) by tp; the norms (and an MoE router) stay whole. PP gives stage s
layers // pp layers, the first layers % pp stages one more; the embedding lives on the first
stage, the final norm and head on the last (a tied head is a copy there when pp > 1). EP
splits the routed experts by ep. A stage's dense parameters are FSDP-sharded over dp_shard x
cp ranks, its experts over dp_shard / ep; dp_replicate replicates.

The terms (``Breakdown``):
- state = B x (dense / (dp_shard x cp) + experts / (dp_shard / ep)).
- gathered: FSDP's unsharded weights in the compute dtype, a x P: without pp, the 2 largest
  blocks (the one computing and the one prefetched) plus the root unit (embedding, final norm,
  head), which FSDP2 keeps unsharded from forward to backward; with pp > 1, the whole stage
  (goodput turns off resharding after forward under pp, ``parallelize._fully_shard``). FSDP
  runs when there is more than one data-parallel rank, or for fp32-master on one.
- held_gradients: with FSDP, more than one micro-batch per step and
  ``sync_every_micro_batch = false`` (the default), FSDP keeps the unsharded gradients in the
  reduce dtype through the accumulation (torch's FSDP2 ``set_requires_gradient_sync(False)``);
  they stand in for the sharded ones: g x (unsharded - sharded) parameters.
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
  share of seq_len. With activation checkpointing a layer keeps only its input (a d / tp),
  plus one layer's full activations while it is recomputed. Under pp, 1F1B keeps up to
  pp - s micro-batches in flight on stage s (no more than the micro-batches of a step).
- logits, on the last stage: micro_batch x tokens x (V (a + 4) / tp + (4d + 4 + a d) / tp + a d):
  the logits and the fp32 log-softmax that the loss keeps (both split by vocabulary under tp),
  the final norm's saved tensors, and the head's input, gathered over the sequence.
- runtime: a flat allowance of RUNTIME_FRACTION of the device for what is not derived: the
  CUDA/XPU context, communication buffers, the caching allocator's fragmentation, the
  gradients of activations in flight in backward, the optimizer step's temporaries.

Does not: allocate anything, model gpipe or interleaved schedules, memory taken by other
processes, or the start-up of a fresh run (which builds the whole model on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from goodput.plan.layout import Layout
from goodput.train.flops import BYTES_PER_PARAMETER, model_size
from goodput.train.model_config import ModelConfig
from goodput.train.parallel_config import (
    context_local_lengths,
    even_layer_split,
    fsdp_shards,
)

GIB = 2**30
PRECISIONS = ("fp32-master", "pure-bf16", "fp32")
COMPUTE_BYTES = {"fp32-master": 2, "pure-bf16": 2, "fp32": 4}
GRADIENT_BYTES = {"fp32-master": 4, "pure-bf16": 2, "fp32": 4}  # FSDP's reduce dtype
GATHERED_BLOCKS = 2  # the block being computed and the one FSDP prefetches
LOSS_BYTES = 4  # the fp32 log-softmax the loss keeps for each logit
RUNTIME_FRACTION = 0.10


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What one step asks, whatever the layout."""

    seq_len: int
    micro_batch_size: int
    global_batch_samples: int  # sequences per optimizer step, all ranks together
    precision: str = "fp32-master"
    activation_checkpointing: bool = False
    sync_every_micro_batch: bool = False

    def accumulation(self, layout: Layout) -> int:
        """Micro-batches per data-parallel rank and step (at least 1)."""
        return max(1, self.global_batch_samples // (self.micro_batch_size * layout.dp))


@dataclass(frozen=True, slots=True)
class Parameters:
    """A model's parameter counts by where a layout puts them."""

    block_split: int  # per block: the matmul weights tp splits (and the shared expert)
    block_whole: int  # per block: the norm gains and the MoE router, never split
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
        whole = 2 * model.dim + (model.dim * moe.num_experts if moe else 0)
        return cls(
            block_split=block - experts - whole,
            block_whole=whole,
            block_experts=experts,
            embedding=size.embedding,
            head=model.vocab_size * model.dim,
            final_norm=model.dim,
            tied=model.tie_embeddings,
        )


@dataclass(frozen=True, slots=True)
class Breakdown:
    """One device's memory, in bytes, on its layout's worst stage."""

    state: float
    gathered: float
    held_gradients: float
    activations: float
    logits: float
    runtime: float
    stage: int  # the pipeline stage these are for (0 without pp)

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
    gathered_inputs = 2 * a * d  # the norm outputs the matmuls keep, over the whole sequence
    rotary = 4 * e  # cos and sin, fp32, e/2 each
    return (norms + attention + mlp) / tp + gathered_inputs + rotary


def estimate(model: ModelConfig, layout: Layout, work: Workload, device_bytes: float) -> Breakdown:
    """The per-device memory of ``layout``: the largest over its pipeline stages."""
    layers = even_layer_split(model.num_layers, layout.pp)
    # Only three stages can be the largest: the first (embedding, the most layers and
    # micro-batches in flight), the first of those with one layer less, and the last (the
    # head and logits); any other stage has no more layers and fewer micro-batches in flight
    # than one of these.
    fewer = model.num_layers % layout.pp
    candidates = sorted({0, min(fewer, layout.pp - 1), layout.pp - 1})
    stages = [_stage(model, layout, work, device_bytes, s, layers[s]) for s in candidates]
    return max(stages, key=lambda breakdown: breakdown.total)


def _stage(
    model: ModelConfig,
    layout: Layout,
    work: Workload,
    device_bytes: float,
    stage: int,
    layers: int,
) -> Breakdown:
    params = Parameters.of(model)
    tp, a = layout.tp, COMPUTE_BYTES[work.precision]
    first, last = stage == 0, stage == layout.pp - 1
    block_dense = params.block_split / tp + params.block_whole
    block_experts = params.block_experts / layout.ep
    root = params.embedding / tp if first else 0.0
    if last:
        untied_or_copied = not params.tied or layout.pp > 1
        root += params.final_norm + (params.head / tp if untied_or_copied else 0.0)
    dense, experts = layers * block_dense + root, layers * block_experts
    sharded = dense / layout.shard + experts / layout.expert_shard

    state = BYTES_PER_PARAMETER[work.precision] * sharded
    gathered = held = 0.0
    accumulation = work.accumulation(layout)
    if fsdp_shards(layout.dp_replicate * layout.shard, work.precision):
        if layout.pp > 1:
            gathered = a * (dense + experts)
        else:
            gathered = a * (min(GATHERED_BLOCKS, layers) * (block_dense + block_experts) + root)
        if accumulation > 1 and not work.sync_every_micro_batch:
            held = GRADIENT_BYTES[work.precision] * (dense + experts - sharded)

    tokens = work.micro_batch_size * max(context_local_lengths(work.seq_len, layout.cp))
    per_layer = layer_activation_bytes(model, a, tp)
    in_flight = min(layout.pp - stage, accumulation)
    if work.activation_checkpointing:
        kept = in_flight * layers * a * model.dim / tp + per_layer
    else:
        kept = in_flight * layers * per_layer
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
        stage=stage,
    )
