"""The parallel layout: how the world's ranks split into parallel dimensions, and nowhere else.

``build_mesh`` reads the degrees of ``[parallel]`` — data parallelism as ``dp_replicate``
replicas of ``dp_shard`` ranks that shard one replica (FSDP), then ``cp``, ``tp`` and ``pp``,
and ``ep``, which borrows its ranks from ``dp_shard`` — fills in the unset data-parallel degree
with what the world size leaves, checks that the product is the world size, builds the
``DeviceMesh`` and hands out, by name, what each part needs:

- ``dp_rank``/``dp_size``: which share of the global batch this rank reads (the batch plan,
  the loader); every rank of one tensor-parallel group, of one context-parallel group and of
  one pipeline reads the same share;
- ``token_group``: the ranks whose tokens together make the global batch (data parallel x
  context parallel): the step counts tokens, sums the loss and, where FSDP does not, the
  gradients over it — never over ``tp``, whose ranks hold the same loss (summing over it
  multiplies the loss by ``tp``; leaving out ``dp`` divides it by ``dp``: the seed's "loss
  1/12 too low"); context-parallel ranks hold different tokens of the same sequences, so they
  are in it;
- ``fsdp_mesh``: what ``parallelize`` shards the model over (``dp_shard`` x ``cp``: the ranks of
  one context-parallel group hold the same weights), and replicates over (``dp_replicate``)
  when there is more than one replica;
- ``data_group``: the data-parallel ranks alone, each with whole micro-batches (an MoE
  layer's routing counts are summed over it);
- ``ep_mesh``: the ranks that split one MoE layer's experts (``ep`` consecutive ranks of
  ``dp_shard``); ``expert_fsdp_mesh``: the ranks holding the same experts, which shard them
  (``dp_shard / ep`` x ``cp``, and replicate over ``dp_replicate``); ``experts_mesh``: what the
  experts are split (``ep``) and replicated (``tp``) over as DTensors;
- ``sequence_group``: the ranks holding one micro-batch's tokens (``cp`` x ``tp``, whose
  sequence parallelism slices them further), among which an MoE layer routes;
- ``cp_group``/``cp_rank``: the ranks that split each sequence (ring attention);
- ``tp_mesh``: the ranks that split each weight matrix; ``pp_group``/``pp_rank``: the stages of
  one pipeline.

Rank order. The mesh is ``pp x dp_replicate x dp_shard x cp x tp`` in row-major order, with
``dp_shard`` split into ``dp_shard / ep`` outside ``cp`` and ``ep`` inside it: ``tp`` varies
fastest, so a tensor-parallel group is ``tp`` consecutive ranks, then ``ep``, then ``cp``.
(``ep`` inside ``cp``: the ranks holding the same experts, ``dp_shard / ep`` x ``cp``, are then
one block of the mesh, as FSDP's mesh beside ``ep`` must be for torch 2.13 to complete the
experts' gradient norm over both.) Every launcher goodput drives
numbers ranks host by host (``srun``'s block distribution, Hydra's ``-ppn``, ``goodput launch``
locally), so when ``tp`` divides the ranks per host each TP group — an all-reduce inside every
layer — stays inside one host, and the pipeline's point-to-point sends cross hosts instead.
``build_mesh`` refuses a ``tp`` that does not divide the ranks per host of a multi-host
placement.

Invariants: every rank builds the same mesh from the same config; the product of the degrees
is the world size; ``ep`` divides ``dp_shard``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from goodput.train.config.parallel import (
    Degrees,
    ParallelConfig,
    check_tp_within_hosts,
    resolve_degrees,
)

# The device mesh's dimensions, outermost first: the layout's (MESH_DIMS), with dp_shard split
# into the ranks holding the same experts and the ep ranks that split them (both 1-sized
# dimensions cost nothing for a dense model), ep inside cp (the module docstring).
DEVICE_MESH_DIMS = ("pp", "dp_replicate", "expert_shard", "cp", "ep", "tp")


@dataclass(frozen=True, slots=True)
class ParallelMesh:
    """The mesh of one run, and its named parts (see the module docstring)."""

    degrees: Degrees
    device_mesh: DeviceMesh  # dimensions DEVICE_MESH_DIMS
    dp_mesh: DeviceMesh  # dp_replicate x dp_shard flattened: every data-parallel rank
    token_mesh: DeviceMesh  # dp_replicate x dp_shard x cp flattened
    fsdp_mesh: DeviceMesh  # dp_shard x cp, after dp_replicate when there are replicas

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.degrees.dp

    @property
    def token_group(self) -> dist.ProcessGroup:
        return self.token_mesh.get_group()

    @property
    def data_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """Collective the first time (flattens a dimension): see the module docstring."""
        shard = self.device_mesh["expert_shard", "cp"]._flatten("expert_shard_cp")
        if self.degrees.dp_replicate > 1:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                return self.device_mesh["dp_replicate", "expert_shard_cp"]
        return shard

    @property
    def ep_mesh(self) -> DeviceMesh:
        return self.device_mesh["ep"]

    @property
    def experts_mesh(self) -> DeviceMesh:
        """``ep`` x ``tp``, or whichever of them splits."""
        names = [name for name in ("ep", "tp") if getattr(self.degrees, name) > 1]
        return self.device_mesh[tuple(names)] if len(names) > 1 else self.device_mesh[names[0]]

    def sequence_group(self) -> dist.ProcessGroup:
        """Collective the first time (flattens a dimension): see the module docstring."""
        return self.device_mesh["cp", "tp"]._flatten("cp_tp").get_group()

    @property
    def tp_rank(self) -> int:
        return self.device_mesh.get_local_rank("tp")

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("cp")

    @property
    def cp_rank(self) -> int:
        return self.device_mesh.get_local_rank("cp")

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.device_mesh["tp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("pp")

    @property
    def pp_rank(self) -> int:
        return self.device_mesh.get_local_rank("pp")


def build_mesh(cfg: ParallelConfig, device: torch.device, ranks_per_host: int) -> ParallelMesh:
    """Collective: the mesh of every rank of the default process group, on ``device``'s type;
    ``ranks_per_host``: the placement's (``Runtime.ranks_per_host``)."""
    world_size = dist.get_world_size()
    degrees = resolve_degrees(cfg, world_size)
    check_tp_within_hosts(degrees.tp, world_size, ranks_per_host)
    device_mesh = init_device_mesh(
        device.type,
        tuple(getattr(degrees, name) for name in DEVICE_MESH_DIMS),
        mesh_dim_names=DEVICE_MESH_DIMS,
    )
    data = ("dp_replicate", "expert_shard", "ep")
    dp_mesh = device_mesh[data]._flatten("dp")
    token_mesh = device_mesh["dp_replicate", "expert_shard", "cp", "ep"]._flatten("dp_cp")
    shard_mesh = device_mesh["expert_shard", "cp", "ep"]._flatten("dp_shard_cp")
    fsdp_mesh = shard_mesh
    if degrees.dp_replicate > 1:
        with warnings.catch_warnings():
            # torch 2.13 still slices a flattened dimension together with a root one (the HSDP
            # mesh FSDP needs); the pinned torch makes the deprecation moot.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            fsdp_mesh = device_mesh["dp_replicate", "dp_shard_cp"]
    return ParallelMesh(degrees, device_mesh, dp_mesh, token_mesh, fsdp_mesh)
