"""A parallel layout (the six degrees of ``[parallel]``) and what goodput's trainer accepts of it.

``Layout`` holds the degrees as ``[parallel]`` names them. The world it needs is pp x
dp_replicate x dp_shard x cp x tp; ``ep`` borrows its ranks from ``dp_shard`` and adds none.
``problems`` says why the trainer would refuse a layout for a model: the rules of
``ParallelConfig.check_model`` and ``mesh.resolve_degrees``, restated here without torch (a test
holds both to the same answers). ``tp_across_hosts`` is the warning for a tensor-parallel group
that spans hosts.

Invariants: degrees are whole numbers >= 1. Does not: read configs or build a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from goodput.train.model import ModelConfig

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


def context_lengths(seq_len: int, cp: int) -> list[int]:
    """The tokens each context-parallel rank holds of one sequence: the sequence is cut into
    2cp near-even chunks (the first seq_len % 2cp one token longer) and rank r holds chunks r
    and 2cp-1-r (the trainer's causally balanced layout)."""
    base, longer = divmod(seq_len, 2 * cp)
    chunk = [base + (index < longer) for index in range(2 * cp)]
    return [chunk[rank] + chunk[2 * cp - 1 - rank] for rank in range(cp)]


def problems(model: ModelConfig, layout: Layout, seq_len: int) -> list[str]:
    """Why goodput's trainer would refuse ``layout`` for ``model`` at ``seq_len``; empty if it
    takes it."""
    found = []
    if model.moe is not None and max(layout.tp, layout.pp, layout.cp) > 1:
        found.append("goodput refuses tp, pp and cp with a mixture-of-experts model today")
    if layout.ep > 1:
        if model.moe is None:
            found.append(f"ep {layout.ep} needs a mixture-of-experts model")
        elif model.moe.num_experts % layout.ep:
            found.append(
                f"ep {layout.ep} does not divide model.moe.num_experts = {model.moe.num_experts}"
            )
        if layout.dp_shard % layout.ep:
            found.append(f"ep {layout.ep} does not divide dp_shard {layout.dp_shard}")
    if layout.cp > 1:
        if layout.pp > 1:
            found.append("goodput refuses cp inside pipeline stages (pp > 1) today")
        if seq_len < 2 * layout.cp:
            found.append(f"cp {layout.cp} needs seq_len >= {2 * layout.cp}, not {seq_len}")
        elif layout.tp > 1 and any(n % layout.tp for n in context_lengths(seq_len, layout.cp)):
            found.append(
                f"tp {layout.tp} does not divide the tokens a cp rank holds of seq_len {seq_len}"
            )
    if layout.tp > 1:
        split = {
            "model.num_heads": model.num_heads,
            "model.num_kv_heads": model.kv_heads,
            "model.ffn_dim": model.mlp_dim,
            "model.vocab_size": model.vocab_size,
        }
        if layout.cp == 1:  # sequence parallelism splits each micro-batch's sequence
            split["seq_len"] = seq_len
        found += [
            f"tp {layout.tp} does not divide {name} = {value}"
            for name, value in split.items()
            if value % layout.tp
        ]
    if layout.pp > model.num_layers:
        found.append(f"pp {layout.pp} is more stages than model.num_layers = {model.num_layers}")
    return found


def tp_across_hosts(layout: Layout, nodes: int, gpus_per_node: int) -> str | None:
    """The warning for a layout whose tensor-parallel groups span hosts (ranks are numbered
    host by host and tp varies fastest, so a group stays on one host only when tp divides the
    devices per host); None when they do not."""
    if nodes == 1 or gpus_per_node % layout.tp == 0:
        return None
    return (
        f"tp {layout.tp} does not divide the {gpus_per_node} devices per node: each "
        "tensor-parallel group would span hosts, with an all-reduce inside every layer over the "
        f"network (goodput's trainer refuses it); choose tp dividing {gpus_per_node} and split "
        "the rest with pp or data parallelism"
    )
