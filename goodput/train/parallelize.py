"""The ``[parallel]`` table and ``parallelize``: the one place that composes a model's layouts.

``parallelize(model, cfg, mesh)`` applies, in this order (each must wrap what the next one
sees): tensor parallelism → activation checkpointing (each block recomputed in backward) →
``torch.compile`` (each block, the checkpointing inside it) → FSDP2 ``fully_shard`` (each block,
then the root: embedding, final norm, output head — tied weights stay in one unit). The
precision policy comes first of all: pure-bf16 casts the whole model. Pipeline parallelism comes
before all of them: ``goodput.train.pipeline`` cuts the model into stages and parallelizes each
stage as a model of its own.

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

Precision policies:
- ``fp32-master`` (default): fp32 weights and optimizer state, bf16 compute, fp32 gradient
  reduction;
- ``pure-bf16``: weights, gradients and optimizer state all bf16 — half the memory, and the
  policy under which small updates can round to zero (the diagnostics need it to reproduce that);
- ``fp32``: everything fp32 (CPU tests compare it with one process).

``train_step`` already divides by the global token count, so FSDP must *sum* gradients, never
average them: the divide factor is 1 and the reduction is forced to a plain SUM, which is also
the only form gloo accepts (it rejects the pre-multiplied sum FSDP would otherwise use).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from goodput.config import limits
from goodput.errors import GoodputError
from goodput.train.model import ModelConfig, Transformer

if TYPE_CHECKING:
    from goodput.train.mesh import ParallelMesh

DEGREE = limits(at_least=1, at_most=2**20)
# The degrees goodput does not split yet, with what each is; both must be 1 for now.
NOT_YET = {"cp": "context parallelism", "ep": "expert parallelism"}
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    data_parallel: Literal["fsdp", "replicate"] = "fsdp"
    # Data-parallel degrees; unset: 1, or for the kind of data parallelism chosen (fsdp:
    # dp_shard, replicate: dp_replicate) whatever the world size leaves (mesh.py).
    dp_replicate: int | None = field(default=None, metadata=DEGREE)
    dp_shard: int | None = field(default=None, metadata=DEGREE)
    tp: int = field(default=1, metadata=DEGREE)
    pp: int = field(default=1, metadata=DEGREE)
    cp: int = field(default=1, metadata=DEGREE)
    ep: int = field(default=1, metadata=DEGREE)  # borrows data-parallel ranks: no factor
    # Tensor parallelism: cross-entropy on the vocabulary shards, never gathering the logits.
    loss_parallel: bool = True
    # Pipeline parallelism (pipeline.py): the schedule; micro-batches per step on each pipeline
    # (None: the batch plan's micro-batches per rank); stages per rank (None: 1, and 2 for
    # interleaved_1f1b); layers per stage in stage order (None: an even split, the first
    # stages taking one more when they do not divide).
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    pp_microbatches: int | None = field(default=None, metadata=DEGREE)
    pp_stages_per_rank: int | None = field(default=None, metadata=DEGREE)
    pp_layers_per_stage: tuple[int, ...] | None = field(default=None, metadata=DEGREE)
    reshard_after_forward: bool = True
    precision: Literal["fp32-master", "pure-bf16", "fp32"] = "fp32-master"
    activation_checkpointing: bool = False  # recompute each block in backward
    compile: bool = False  # torch.compile each block
    # FSDP: reduce-scatter gradients after every micro-batch, keeping only sharded gradients;
    # false: once per step, holding unsharded gradients across the accumulation (memory for
    # communication, bench_train).
    sync_every_micro_batch: bool = False

    def __post_init__(self) -> None:
        def refuse(what: str, fix: str) -> None:
            raise GoodputError.usage("[parallel]", what, fix)

        for name, kind in NOT_YET.items():
            if getattr(self, name) > 1:
                refuse(
                    f"{name} = {getattr(self, name)}: {kind} is not supported yet",
                    f"set {name} = 1: data parallelism, tp and pp are today",
                )
        # fp32-master's bf16 compute comes from FSDP's mixed-precision policy; a replicated model
        # has no such hook and would silently train in fp32.
        if self.data_parallel == "replicate" and self.precision == "fp32-master":
            refuse(
                "precision 'fp32-master' needs data_parallel = 'fsdp'",
                "use data_parallel = 'fsdp', or precision 'fp32' or 'pure-bf16' with 'replicate'",
            )
        if self.data_parallel == "replicate" and (self.dp_shard or 1) > 1:
            refuse(
                f"dp_shard = {self.dp_shard}, but data_parallel = 'replicate' shards nothing",
                "leave dp_shard unset, or use data_parallel = 'fsdp'",
            )
        if self.compile and self.tp > 1:
            # Checked on CPU: a compiled block under tensor parallelism ran, with fp32-master,
            # to a gradient norm of 0.65 where every other layout gives 0.85 (and in fp32 did not
            # finish its first step in 5 minutes).
            refuse(
                f"compile = true with tp = {self.tp}: a compiled tensor-parallel block computes "
                "wrong gradients on torch 2.13",
                "set compile = false for tensor-parallel runs (compile works with dp and pp)",
            )
        interleaved = self.pp_schedule == "interleaved_1f1b"
        if interleaved and self.stages_per_rank < 2:
            refuse(
                "pp_schedule 'interleaved_1f1b' needs pp_stages_per_rank >= 2",
                "raise pp_stages_per_rank, or use pp_schedule '1f1b' or 'gpipe'",
            )
        if not interleaved and self.stages_per_rank != 1:
            refuse(
                f"pp_stages_per_rank = {self.stages_per_rank} needs pp_schedule 'interleaved_1f1b'",
                f"set pp_schedule = 'interleaved_1f1b', or pp_stages_per_rank = 1 with "
                f"'{self.pp_schedule}'",
            )
        if self.pp_layers_per_stage is not None and len(self.pp_layers_per_stage) != (
            self.num_stages
        ):
            refuse(
                f"pp_layers_per_stage lists {len(self.pp_layers_per_stage)} stages, but pp "
                f"{self.pp} x pp_stages_per_rank {self.stages_per_rank} = {self.num_stages}",
                f"list {self.num_stages} layer counts, or leave it unset for an even split",
            )

    @property
    def stages_per_rank(self) -> int:
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 2 if self.pp_schedule == "interleaved_1f1b" else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def check_model(self, model: ModelConfig, seq_len: int) -> None:
        """Refuse a layout that cannot split ``model`` (a usage error naming what to change)."""

        def refuse(what: str, fix: str) -> None:
            raise GoodputError.usage("[parallel]", what, fix)

        if model.moe is not None and (self.tp > 1 or self.pp > 1):
            refuse(
                f"tp = {self.tp}, pp = {self.pp} with a mixture-of-experts model: not supported "
                "yet",
                "set tp = 1 and pp = 1 and shard the MoE model with FSDP (dp_shard)",
            )
        if self.tp > 1:
            split = {
                "model.num_heads": model.num_heads,
                "model.num_kv_heads": model.kv_heads,
                "model.ffn_dim": model.mlp_dim,
                "model.vocab_size": model.vocab_size,
                # Sequence parallelism splits each micro-batch's sequence.
                "train.seq_len": seq_len,
            }
            for name, value in split.items():
                if value % self.tp:
                    refuse(
                        f"tp = {self.tp} does not divide {name} = {value}",
                        f"choose tp dividing {name}, or change {name}",
                    )
        if self.pp > 1:
            layers = self.pp_layers_per_stage
            if layers is not None and sum(layers) != model.num_layers:
                refuse(
                    f"pp_layers_per_stage sums to {sum(layers)} layers, but model.num_layers = "
                    f"{model.num_layers}",
                    "make the counts add up to model.num_layers",
                )
            if layers is None and self.num_stages > model.num_layers:
                refuse(
                    f"{self.num_stages} pipeline stages for {model.num_layers} layers",
                    "lower pp or pp_stages_per_rank to at most model.num_layers stages",
                )


def parallelize(
    model: Transformer, cfg: ParallelConfig, mesh: ParallelMesh | None = None
) -> Transformer:
    """Apply ``cfg``'s layouts to ``model`` (a whole model or one pipeline stage) in place, in
    the order of the module docstring; return it. ``mesh`` None: every rank of the default
    group is a data-parallel shard."""
    if cfg.precision == "pure-bf16":
        model.to(torch.bfloat16)
    if mesh is not None and mesh.degrees.tp > 1:
        _tensor_parallel(model, mesh.tp_mesh, loss_parallel=cfg.loss_parallel)
    blocks = model.blocks
    if cfg.activation_checkpointing:
        for key, block in blocks.items():
            # Checkpoints leave the wrapper out of their names: resumable either way.
            blocks[key] = checkpoint_wrapper(block)
    if cfg.compile:
        for block in blocks.values():
            block.compile()
    if cfg.data_parallel == "fsdp":
        _fully_shard(model, cfg, mesh)
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
    for block in model.blocks.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": gather_sequence,
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": gather_sequence,
            "mlp.w1": ColwiseParallel(),
            "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]


def _fully_shard(model: Transformer, cfg: ParallelConfig, mesh: ParallelMesh | None) -> None:
    num_ranks = mesh.dp_size if mesh is not None else dist.get_world_size()
    # FSDP on one rank shards nothing, yet its hooks cost ~12% of a CPU step (bench_train);
    # only fp32-master needs it there, for its bf16 compute policy.
    if num_ranks == 1 and cfg.precision != "fp32-master":
        return
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.precision == "fp32-master"
        else MixedPrecisionPolicy()
    )
    fsdp_mesh = mesh.fsdp_mesh if mesh is not None else None
    # A pipeline stage runs forward once per micro-batch: resharding after each would gather
    # its weights again for every one.
    reshard = cfg.reshard_after_forward and (mesh is None or mesh.degrees.pp == 1)
    for block in model.blocks.values():
        fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def compute_dtype(cfg: ParallelConfig) -> torch.dtype:
    """The dtype the matmuls run in under ``cfg``'s precision policy."""
    return torch.float32 if cfg.precision == "fp32" else torch.bfloat16
