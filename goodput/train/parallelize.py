"""The ``[parallel]`` table and ``parallelize``: the one place that composes a model's layouts.

``parallelize(model, cfg, mesh)`` applies, in this order (each must wrap what the next one
sees): tensor parallelism (not yet) → activation checkpointing (each block recomputed in
backward) → ``torch.compile`` (each block, the checkpointing inside it) → FSDP2
``fully_shard`` (each block, then the root: embedding, final norm, output head — tied weights
stay in one unit). The precision policy comes first of all: pure-bf16 casts the whole model.

Data parallelism (``data_parallel``): ``fsdp`` shards over ``dp_shard`` ranks and replicates
over ``dp_replicate`` (HSDP when both are > 1); on a single rank FSDP is applied only for
``fp32-master``, whose bf16 compute comes from FSDP's policy. ``replicate``: every rank keeps
the whole model and ``train_step`` sums the gradients itself; right for models that fit easily.
How the degrees are read and checked against the world size is ``mesh.py``'s.

Precision policies:
- ``fp32-master`` (default): fp32 weights and optimizer state, bf16 compute, fp32 gradient
  reduction;
- ``pure-bf16``: weights, gradients and optimizer state all bf16 — half the memory, and the
  policy under which small updates can round to zero (the diagnostics need it to reproduce that);
- ``fp32``: everything fp32 (CPU tests compare it bit-for-bit with one process).

``train_step`` already divides by the global token count, so FSDP must *sum* gradients, never
average them: the divide factor is 1 and the reduction is forced to a plain SUM, which is also
the only form gloo accepts (it rejects the pre-multiplied sum FSDP would otherwise use).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from goodput.config import limits
from goodput.errors import GoodputError

if TYPE_CHECKING:
    from goodput.train.mesh import ParallelMesh

DEGREE = limits(at_least=1, at_most=2**20)
# The degrees other than data parallelism, with what each is; all must be 1 for now.
NOT_YET = {
    "tp": "tensor parallelism",
    "pp": "pipeline parallelism",
    "cp": "context parallelism",
    "ep": "expert parallelism",
}


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
                    f"set {name} = 1: only data parallelism (dp_replicate x dp_shard) is today",
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


def parallelize(
    model: nn.Module, cfg: ParallelConfig, mesh: ParallelMesh | None = None
) -> nn.Module:
    """Apply ``cfg``'s layouts to ``model`` in place, in the order of the module docstring;
    return it. ``mesh`` None: every rank of the default group is a data-parallel shard."""
    if cfg.precision == "pure-bf16":
        model.to(torch.bfloat16)
    blocks: nn.ModuleList = model.blocks  # type: ignore[assignment]
    if cfg.activation_checkpointing:
        for index, block in enumerate(blocks):
            # Checkpoints leave the wrapper out of their names: resumable either way.
            blocks[index] = checkpoint_wrapper(block)
    if cfg.compile:
        for block in blocks:
            block.compile()
    if cfg.data_parallel == "fsdp":
        _fully_shard(model, cfg, mesh)
    return model


def _fully_shard(model: nn.Module, cfg: ParallelConfig, mesh: ParallelMesh | None) -> None:
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
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(
            block, mesh=fsdp_mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy
        )
    fully_shard(
        model, mesh=fsdp_mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def compute_dtype(cfg: ParallelConfig) -> torch.dtype:
    """The dtype the matmuls run in under ``cfg``'s precision policy."""
    return torch.float32 if cfg.precision == "fp32" else torch.bfloat16
