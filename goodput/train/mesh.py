"""The parallel layout: how the world's ranks split into parallel dimensions, and nowhere else.

``build_mesh`` reads the degrees of ``[parallel]`` — data parallelism as ``dp_replicate``
replicas of ``dp_shard`` ranks that shard one replica (FSDP), then ``tp``, ``pp``, ``cp``; ``ep``
borrows data-parallel ranks and is no factor — fills in the unset data-parallel degree with
what the world size leaves, checks that the product is the world size, builds the
``DeviceMesh`` (dimensions ``dp_replicate`` x ``dp_shard``, and their flattening ``dp``) and
hands out, by name, what each part needs:

- ``dp_rank``/``dp_size``: which share of the global batch this rank reads (the batch plan,
  the loader);
- ``dp_group``: the ranks whose shares together make the global batch: the step counts tokens,
  sums the loss and, where FSDP does not, the gradients over it;
- ``fsdp_mesh``: what ``parallelize`` shards over (``dp_shard``), and replicates over
  (``dp_replicate``) when there is more than one replica.

Invariants: every rank builds the same mesh from the same config; the product of the degrees
is the world size. Only data parallelism may be > 1 today: the others are refused, as "not
yet", when the config is read (``ParallelConfig``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from goodput.errors import GoodputError
from goodput.train.parallelize import ParallelConfig


@dataclass(frozen=True, slots=True)
class Degrees:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def product(self) -> int:
        """The number of ranks this layout needs (``ep`` borrows its ranks)."""
        return self.dp * self.tp * self.pp * self.cp


def resolve_degrees(cfg: ParallelConfig, world_size: int) -> Degrees:
    """``cfg``'s degrees with the unset ones filled in; a usage error, suggesting a split that
    works, when they do not multiply to ``world_size``."""
    others = cfg.tp * cfg.pp * cfg.cp
    # The kind of data parallelism chosen takes what is left; the other data-parallel degree
    # defaults to 1.
    rest = "dp_shard" if cfg.data_parallel == "fsdp" else "dp_replicate"
    fixed = "dp_replicate" if rest == "dp_shard" else "dp_shard"
    fixed_degree = getattr(cfg, fixed) or 1
    rest_degree = getattr(cfg, rest) or world_size // (fixed_degree * others) or 1
    degrees = Degrees(
        **{fixed: fixed_degree, rest: rest_degree},
        tp=cfg.tp,
        pp=cfg.pp,
        cp=cfg.cp,
        ep=cfg.ep,
    )
    if degrees.product() != world_size:
        raise GoodputError.usage(
            "[parallel]",
            f"dp_replicate {degrees.dp_replicate} x dp_shard {degrees.dp_shard} x tp {cfg.tp} "
            f"x pp {cfg.pp} x cp {cfg.cp} = {degrees.product()} ranks, but the world has "
            f"{world_size}",
            _suggest(cfg, world_size, fixed, rest),
        )
    return degrees


def _suggest(cfg: ParallelConfig, world_size: int, fixed: str, rest: str) -> str:
    others = cfg.tp * cfg.pp * cfg.cp
    if world_size % others:
        return f"launch a multiple of tp x pp x cp = {others} ranks"
    data_parallel = world_size // others
    fixed_degree = math.gcd(getattr(cfg, fixed) or 1, data_parallel)
    return (
        f"e.g. {fixed} = {fixed_degree}, {rest} = {data_parallel // fixed_degree} (or leave "
        f"{rest} unset: it takes what the world size leaves)"
    )


@dataclass(frozen=True, slots=True)
class ParallelMesh:
    """The mesh of one run, and its named parts (see the module docstring)."""

    degrees: Degrees
    device_mesh: DeviceMesh  # dimensions dp_replicate x dp_shard
    dp_mesh: DeviceMesh  # their flattening: every data-parallel rank

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.degrees.dp

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """One dimension (shard) for FSDP; two (replicate, shard: HSDP) with replicas."""
        if self.degrees.dp_replicate > 1:
            return self.device_mesh
        return self.device_mesh["dp_shard"]


def build_mesh(cfg: ParallelConfig, device: torch.device) -> ParallelMesh:
    """Collective: the mesh of every rank of the default process group, on ``device``'s type."""
    degrees = resolve_degrees(cfg, dist.get_world_size())
    device_mesh = init_device_mesh(
        device.type,
        (degrees.dp_replicate, degrees.dp_shard),
        mesh_dim_names=("dp_replicate", "dp_shard"),
    )
    return ParallelMesh(degrees, device_mesh, device_mesh._flatten("dp"))
