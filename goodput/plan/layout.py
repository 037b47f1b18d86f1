"""A parallel layout (the six degrees of ``[parallel]``) and what goodput's trainer accepts of it.

``Layout`` holds the degrees as ``[parallel]`` names them. The world it needs is pp x
dp_replicate x dp_shard x cp x tp; ``ep`` borrows its ranks from ``dp_shard`` and adds none.
``problems`` says why the trainer would refuse a layout for a model: the trainer's own rules
(``goodput.train.parallel_config``, torch-free). ``tp_across_hosts`` is the warning for a
tensor-parallel group that spans hosts.

Invariants: degrees are whole numbers >= 1. Does not: read configs or build a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

from goodput.errors import GoodputError
from goodput.train.model_config import ModelConfig
from goodput.train.parallel_config import ParallelConfig, check_tp_within_hosts, resolve_degrees

# In the order of the pasteable overrides; the mesh's own order is MESH_ORDER.
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # splits the routed experts over ranks of dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own share of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """The ranks FSDP shards a stage's dense state over (context-parallel ranks hold the
        same weights, so FSDP shards over them too)."""
        return self.dp_shard * self.cp

    @property
    def expert_shard(self) -> int:
        """The ranks holding the same experts, which FSDP shards them over."""
        return self.dp_shard // self.ep

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DEGREES}

    def overrides(self) -> str:
        """The layout as ``goodput train`` overrides, ready to paste."""
        return " ".join(f"parallel.{name}={value}" for name, value in self.degrees().items())

    def describe(self) -> str:
        """The degrees above 1 in the mesh's order, e.g. ``dp_shard 24 x tp 4``."""
        parts = [f"{name} {getattr(self, name)}" for name in MESH_ORDER if getattr(self, name) > 1]
        line = " x ".join(parts) or "1 device"
        return line + (f" (ep {self.ep} within dp_shard)" if self.ep > 1 else "")


def problems(model: ModelConfig, layout: Layout, seq_len: int) -> list[str]:
    """Why goodput's trainer would refuse ``layout`` for ``model`` at ``seq_len`` (its own
    checks, ``ParallelConfig`` and ``resolve_degrees``, and their reason); empty if it takes
    it."""
    try:
        cfg = ParallelConfig(
            dp_replicate=layout.dp_replicate,
            dp_shard=layout.dp_shard,
            tp=layout.tp,
            pp=layout.pp,
            cp=layout.cp,
            ep=layout.ep,
        )
        cfg.check_model(model, seq_len)
        resolve_degrees(cfg, layout.world)
    except GoodputError as error:
        return [error.what]
    return []


def tp_across_hosts(layout: Layout, nodes: int, gpus_per_node: int) -> str | None:
    """The warning for a layout whose tensor-parallel groups span hosts (the trainer's refusal,
    ``check_tp_within_hosts``); None when they do not."""
    try:
        check_tp_within_hosts(layout.tp, nodes * gpus_per_node, gpus_per_node)
    except GoodputError as error:
        return f"{error.what}; {error.fix} (goodput's trainer refuses it)"
    return None
