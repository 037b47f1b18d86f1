"""``parallelize``: the one place that composes a model's layouts (``[parallel]`` itself, and
the rules a layout must meet, are ``config/parallel.py``'s).

``parallelize(model, cfg, mesh)`` applies, in this order (each must wrap what the next one
sees): FP8 (``fp8``: the blocks' linear layers become torchao's float8 linears, ``float8``) →
tensor parallelism → expert parallelism → context parallelism → activation checkpointing
(what each block keeps for backward: ``activation_checkpoint``) → ``torch.compile`` (each
block's own forward, inside its checkpointing and module hooks: ``compile`` says why) → FSDP2
``fully_shard`` (each block, its split experts a unit of their own, then the root: embedding,
final norm, output head — tied weights stay in one unit). The precision policy
comes first of all: a policy whose weights are not fp32 (pure-bf16) casts them (the buffers stay
fp32). Pipeline parallelism
comes before all of them: ``goodput.train.parallel.pipeline`` cuts the model into stages and
parallelizes each stage as a model of its own.

Data parallelism (``data_parallel``): ``fsdp`` shards over ``dp_shard`` ranks and replicates
over ``dp_replicate`` (HSDP when both are > 1); on a single data-parallel rank FSDP is applied
only for ``fp32-master``, whose bf16 compute comes from FSDP's policy. ``replicate``: every rank
keeps the whole model and ``train_step`` sums the gradients itself; right for models that fit
easily. How the degrees are read and checked against the world size is ``mesh.py``'s.

Tensor parallelism (``tp``), Megatron-style with sequence parallelism: ``wq``/``wk``/``wv`` and
``w1``/``w3`` are split by output (column-wise: each rank holds heads / tp heads and ffn / tp
hidden units), ``wo`` and ``w2`` by input (row-wise), so each half of a block costs one
all-gather of the sequence on the way in and one reduce-scatter on the way out. Between them
the residual stream and the norms are split along the sequence (sequence parallelism), so
activations outside the matmuls are 1/tp per rank. The embedding is split by vocabulary rows;
the output head by vocabulary columns, and with ``loss_parallel`` the logits stay split and the
cross-entropy is computed on the shards (``torch.distributed.tensor.parallel.loss_parallel``):
the ``[tokens, vocab]`` logits are never gathered.

Expert parallelism (``ep``, MoE models): each MoE layer's grouped expert weights are split by
expert over ``ep`` ranks borrowed from ``dp_shard``, tokens reach their experts by all-to-all
(``goodput.train.experts``); FSDP then shards the experts, as a unit of their own, over the
``dp_shard / ep`` x ``cp`` ranks holding the same ones (and replicates them over
``dp_replicate``).

An MoE layer under tensor and context parallelism runs on this rank's own tokens: its two
chunks of each sequence (cp), sequence parallelism's slice of them (tp) — no all-gather before
it, no reduce-scatter after. Its weights (router, shared expert, experts) are replicated over
``tp`` (``SequenceParallel`` for the router and the shared expert, replicated DTensors for the
experts), each rank's gradient its tokens' share, summed over ``tp``; over ``cp`` FSDP sums
them as any weight's. Not expert tensor parallelism (each expert split over ``tp``, torchtitan's
ETP): that needs the sequence gathered around every MoE layer — an all-gather and a
reduce-scatter of the activations — to save the expert memory FSDP already shards over
``dp_shard`` (docs/parallel.md). The layer routes over the whole micro-batch, gathering every
rank's chosen experts (``model.TokenSplit``), so capacity and balancing are one process's.

Context parallelism (``cp``): each rank holds two mirrored chunks of every sequence and its
attention runs ring attention over the ``cp`` ranks (``goodput.train.ring_attention``); the
weights are the same on those ranks, so FSDP shards over ``dp_shard x cp`` and sums their
gradients, as the step sums their losses and token counts.

Precision policies: ``goodput.train.config.precision``'s table says what each one holds and
computes in; here its dtype names become torch's (``DTYPES``), and a mixed policy (fp32-master)
becomes FSDP's mixed-precision policy.

``train_step`` already divides by the global token count, so FSDP must *sum* gradients, never
average them: the divide factor is 1 and the reduction is forced to a plain SUM, which is also
the only form gloo accepts (it rejects the pre-multiplied sum FSDP would otherwise use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from goodput.train.config.parallel import ParallelConfig, fsdp_shards
from goodput.train.config.precision import PRECISIONS
from goodput.train.device import detect_device_type
from goodput.train.experts import GroupedExperts, distribute_experts
from goodput.train.model import Attention, ContextParallel, MoE, TokenSplit, Transformer
from goodput.train.parallel.activation_checkpoint import checkpoint_blocks
from goodput.train.parallel.collectives import CountedAllGather, CountedReduceScatter
from goodput.train.parallel.compile import compile_blocks
from goodput.train.parallel.float8 import convert_blocks
from goodput.train.parallel.grad_tally import GradientTally
from goodput.train.ring_attention import ContextLayout

if TYPE_CHECKING:
    from goodput.train.parallel.mesh import ParallelMesh

# The precision table's dtype names, as torch's dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parallelize(
    model: Transformer,
    cfg: ParallelConfig,
    mesh: ParallelMesh | None = None,
    *,
    context: ContextLayout | None = None,
    tally: GradientTally | None = None,
) -> Transformer:
    """Apply ``cfg``'s layouts to ``model`` (a whole model or one pipeline stage) in place, in
    the order of the module docstring; return it. ``mesh`` None: every rank of the default
    group is a data-parallel shard. ``context``: how context parallelism splits the training
    sequences (``build.context_layout``; needed when ``cp`` > 1). ``tally``: FSDP's
    reduce-scatters add up the squares of each rank's own gradient there (``grad_tally``)."""
    weights = DTYPES[PRECISIONS[cfg.precision].weights]
    if weights != torch.float32:
        # The weights only (``.data``: a tied weight stays one). The buffers stay fp32: the
        # rotary frequencies in bf16 put ~0.4 rad of error into the angle at position 4096,
        # and an MoE layer's token counts in bf16 stop counting past 256.
        for parameter in model.parameters():
            parameter.data = parameter.data.to(weights)
    if cfg.fp8 is not None:
        device_type = mesh.device_mesh.device_type if mesh is not None else detect_device_type()
        convert_blocks(model, cfg, device_type=device_type, gather_float8=_shards(cfg, mesh))
    if mesh is not None and mesh.degrees.tp > 1:
        _tensor_parallel(model, mesh.tp_mesh, loss_parallel=cfg.loss_parallel)
    if mesh is not None and model.cfg.moe is not None and mesh.degrees.ep * mesh.degrees.tp > 1:
        distribute_experts(model, mesh.experts_mesh)
    if mesh is not None and mesh.degrees.cp > 1:
        assert context is not None, "context parallelism splits the training sequences"
        for module in model.modules():
            if isinstance(module, Attention):
                module.context = ContextParallel(context, mesh.cp_group)
    if mesh is not None and model.cfg.moe is not None and mesh.degrees.cp * mesh.degrees.tp > 1:
        split = TokenSplit(mesh.sequence_group(), mesh.degrees.tp, mesh.tp_rank)
        for layer in model.moe_layers():
            layer.split = split
    blocks = model.blocks
    checkpoint_blocks(blocks, cfg)
    if cfg.compile:
        compile_blocks(blocks)
    if cfg.data_parallel == "fsdp":
        _fully_shard(model, cfg, mesh, tally)
    return model


def _tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    """Split ``model``'s matmuls over ``tp_mesh`` (the module docstring's plan). Between blocks
    the residual stream is this rank's slice of the sequence, as a plain tensor."""
    outer: dict[str, object] = {}
    if model.embedding is not None:
        outer["embedding"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        outer["norm"] = SequenceParallel()
    if model.output is not None:
        outer["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, outer)  # type: ignore[arg-type]
    if model.cfg.tie_embeddings and model.embedding is not None and model.output is not None:
        # Each plan replaced its module's weight with a DTensor of its own; both are split by
        # vocabulary rows, so one of them serves both again.
        model.output.weight = model.embedding.weight
    gather_sequence = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    # The positions beside the hidden states are every rank's alike: left as they are.
    gather_attention_input = PrepareModuleInput(
        input_layouts=(Shard(1), None),
        desired_input_layouts=(Replicate(), None),
        use_local_output=True,
    )
    for block in model.blocks.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": gather_attention_input,
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
        }
        if isinstance(block.mlp, MoE):
            plan |= _moe_plan(block.mlp)
        else:
            plan |= {
                "mlp": gather_sequence,
                "mlp.w1": ColwiseParallel(),
                "mlp.w3": ColwiseParallel(),
                "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
            }
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]


def _moe_plan(moe: MoE) -> dict[str, ParallelStyle]:
    """An MoE layer on this rank's slice of the sequence, as a plain tensor (the module
    docstring): its router and shared expert replicated, applied to the slice's tokens (dim 0
    of the flattened ``[tokens, dim]``); the experts are ``distribute_experts``'."""
    own_tokens = SequenceParallel(sequence_dim=0, use_local_output=True)
    plan: dict[str, ParallelStyle] = {
        "mlp": PrepareModuleInput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Shard(1), None),
            use_local_output=True,
        ),
        "mlp.router": own_tokens,
    }
    if moe.shared is not None:
        plan |= dict.fromkeys(("mlp.shared.w1", "mlp.shared.w3", "mlp.shared.w2"), own_tokens)
    return plan


def _shards(cfg: ParallelConfig, mesh: ParallelMesh | None) -> bool:
    """Whether ``_fully_shard`` applies FSDP to this model."""
    if cfg.data_parallel != "fsdp":
        return False
    num_ranks = mesh.fsdp_mesh.size() if mesh is not None else dist.get_world_size()
    return fsdp_shards(num_ranks, cfg.precision)


def _fully_shard(
    model: Transformer, cfg: ParallelConfig, mesh: ParallelMesh | None, tally: GradientTally | None
) -> None:
    if not _shards(cfg, mesh):
        return
    precision = PRECISIONS[cfg.precision]
    policy = (
        MixedPrecisionPolicy(
            param_dtype=DTYPES[precision.compute], reduce_dtype=DTYPES[precision.reduce]
        )
        if precision.mixed
        else MixedPrecisionPolicy()
    )
    fsdp_mesh = mesh.fsdp_mesh if mesh is not None else None
    # A pipeline stage runs forward once per micro-batch: resharding after each would gather
    # its weights again for every one.
    reshard = cfg.reshard_after_forward and (mesh is None or mesh.degrees.pp == 1)
    for block in model.blocks.values():
        if mesh is not None and mesh.degrees.ep > 1:
            # Split experts are one FSDP unit of their own, sharded over the ranks holding the
            # same experts (the block's other weights shard over all of dp_shard x cp).
            for experts in block.modules():
                if isinstance(experts, GroupedExperts):
                    fully_shard(
                        experts,
                        mesh=mesh.expert_fsdp_mesh(),
                        reshard_after_forward=reshard,
                        mp_policy=policy,
                    )
        fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    # Every unit's collectives counted in the beacon (the reduce-scatter also feeds the tally).
    all_gather, reduce_scatter = CountedAllGather(), CountedReduceScatter(tally)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)


def compute_dtype(cfg: ParallelConfig) -> torch.dtype:
    """The dtype the matmuls run in under ``cfg``'s precision policy."""
    return DTYPES[PRECISIONS[cfg.precision].compute]
