"""Data parallelism and the precision policy, applied to a built model.

``fsdp``: FSDP2 ``fully_shard`` on every block and then the root (embedding, final norm, output
head — tied weights stay in one unit); on a single rank only for ``fp32-master``, whose bf16
compute comes from FSDP's policy. ``replicate``: every rank keeps the whole model and
``train_step`` sums gradients itself; right for models that fit easily.

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

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from goodput.errors import GoodputError


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    data_parallel: Literal["fsdp", "replicate"] = "fsdp"
    reshard_after_forward: bool = True
    precision: Literal["fp32-master", "pure-bf16", "fp32"] = "fp32-master"

    def __post_init__(self) -> None:
        # fp32-master's bf16 compute comes from FSDP's mixed-precision policy; a replicated model
        # has no such hook and would silently train in fp32.
        if self.data_parallel == "replicate" and self.precision == "fp32-master":
            raise GoodputError.usage(
                "[parallel]",
                "precision 'fp32-master' needs data_parallel = 'fsdp'",
                "use data_parallel = 'fsdp', or precision 'fp32' or 'pure-bf16' with 'replicate'",
            )


def parallelize(model: nn.Module, cfg: ParallelConfig, mesh: DeviceMesh | None = None) -> nn.Module:
    """Apply the precision policy and data parallelism to ``model`` in place; return it."""
    if cfg.precision == "pure-bf16":
        model.to(torch.bfloat16)
    if cfg.data_parallel == "replicate":
        return model
    num_ranks = mesh.size() if mesh is not None else dist.get_world_size()
    # FSDP on one rank shards nothing, yet its hooks cost ~12% of a CPU step (bench_train);
    # only fp32-master needs it there, for its bf16 compute policy.
    if num_ranks == 1 and cfg.precision != "fp32-master":
        return model
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.precision == "fp32-master"
        else MixedPrecisionPolicy()
    )
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(
            block, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy
        )
    fully_shard(model, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def compute_dtype(cfg: ParallelConfig) -> torch.dtype:
    """The dtype the matmuls run in under ``cfg``'s precision policy."""
    return torch.float32 if cfg.precision == "fp32" else torch.bfloat16
