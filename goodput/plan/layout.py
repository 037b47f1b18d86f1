"""A parallel layout (the six degrees of ``[parallel]``, the pipeline's schedule, stages per rank
and layers per stage, and how each block computes: activation checkpointing, fp8 matmuls,
torch.compile) and what goodput's trainer accepts of it.

``Layout`` is the trainer's ``Degrees`` (``goodput.train.config.parallel``: the degrees as
``[parallel]`` names them, ``dp``, ``expert_shard`` and the world they need, ``product()`` = pp
x dp_replicate x dp_shard x cp x tp; ``ep`` borrows its ranks from ``dp_shard`` and adds none)
with the choices the planner weighs beside them (``AC_MODES``, ``FP8_RECIPES``, compile: the
trainer's ``[parallel]`` keys of the same names).
``balanced_layer_split`` is the planner's split of layers that do not divide into the stages
(the first and the last stage, which hold the embedding and the head, take fewer).
``problems`` says why the trainer would refuse a layout for a model: the trainer's own rules
(``goodput.train.config.parallel``, torch-free). ``tp_across_hosts`` is the warning for a
tensor-parallel group that spans hosts; ``spans_hosts`` says which groups do.

Invariants: degrees are whole numbers >= 1. Does not: read configs or build a mesh.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, replace
from typing import Any

from goodput.errors import GoodputError
from goodput.train.config.model import ModelConfig
from goodput.train.config.parallel import (
    MESH_DIMS,
    Degrees,
    ParallelConfig,
    check_tp_within_hosts,
    context_local_lengths,
    default_stages_per_rank,
    even_layer_split,
    rank_stages,
    resolve_degrees,
)

# The planner asks the same questions of thousands of layouts that share a shape: these caches
# keep each answer that costs more than a few operations (a list of cp lengths, of pp stages)
# to one computation per shape.
CACHED = 1 << 16


def _literal_values(hint: Any) -> tuple[str, ...]:
    """The strings a ``Literal[...]`` annotation admits (also within ``Literal[...] | None``)."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return tuple(value for arg in typing.get_args(hint) for value in _literal_values(arg))


_TRAINER = typing.get_type_hints(ParallelConfig)
# The trainer's own names (one definition: its [parallel] annotations). activation_checkpointing:
# nothing, whole blocks, the per-op policy (saves the matmuls' and attention's outputs,
# recomputes the rest), a memory budget (torch's activation_memory_budget, under compile only);
# fp8: torchao's float8 scalings.
AC_MODES = _literal_values(_TRAINER["activation_checkpointing"])
FP8_RECIPES = _literal_values(_TRAINER["fp8"])


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout(Degrees):
    """The degrees (``Degrees``'s fields, 1 unless given), and how the blocks and layers are
    placed."""

    activation_checkpointing: str = "none"  # one of AC_MODES
    activation_memory_budget: float = 0.5  # "budget" only: the share of "none"'s activations kept
    fp8: str | None = None  # one of FP8_RECIPES: the blocks' linear layers in float8
    compile: bool = False  # torch.compile each block
    pp_schedule: str = "1f1b"  # a [parallel] pp_schedule value (read under pp > 1 only)
    pp_stages_per_rank: int | None = None  # None: the schedule's default
    pp_layers_per_stage: tuple[int, ...] | None = None  # None: the trainer's even split

    @property
    def shard(self) -> int:
        """The ranks FSDP shards a stage's dense state over (context-parallel ranks hold the
        same weights, so FSDP shards over them too)."""
        return self.dp_shard * self.cp

    @property
    def expert_fsdp(self) -> int:
        """The ranks FSDP shards a stage's routed experts over: those of dp_shard holding the
        same experts (``expert_shard``) times the context-parallel ranks."""
        return self.expert_shard * self.cp

    @property
    def stages_per_rank(self) -> int:
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return default_stages_per_rank(self.pp_schedule) if self.pp > 1 else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers per pipeline stage, in stage order, as the trainer cuts them."""
        if self.pp_layers_per_stage is not None:
            return self.pp_layers_per_stage
        return _even_split(num_layers, self.num_stages)

    def rank_stages(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``pp_rank`` holds (the trainer's ``rank_stages``)."""
        return tuple(rank_stages(self.pp_schedule, self.pp, self.stages_per_rank, pp_rank))

    def overrides(self) -> str:
        """The layout as ``goodput train`` overrides, ready to paste: the six degrees, then
        activation checkpointing, fp8, compile and the layers per stage when they are set
        (a bare word is a string to the override parser: ``parallel.fp8=rowwise``)."""
        items = [f"parallel.{name}={value}" for name, value in self.by_name().items()]
        if self.activation_checkpointing != "none":
            items.append(f"parallel.activation_checkpointing={self.activation_checkpointing}")
        if self.activation_checkpointing == "budget":
            items.append(f"parallel.activation_memory_budget={self.activation_memory_budget:g}")
        if self.fp8 is not None:
            items.append(f"parallel.fp8={self.fp8}")
        if self.compile:
            items.append("parallel.compile=true")
        if self.pp > 1 and self.pp_schedule != "1f1b":
            items.append(f"parallel.pp_schedule={self.pp_schedule}")
        if self.pp > 1 and self.pp_stages_per_rank is not None:
            items.append(f"parallel.pp_stages_per_rank={self.pp_stages_per_rank}")
        if self.pp_layers_per_stage is not None:
            items.append(
                f"parallel.pp_layers_per_stage=[{','.join(map(str, self.pp_layers_per_stage))}]"
            )
        return " ".join(items)

    def describe(self) -> str:
        """The degrees above 1 in the mesh's order, then how the blocks compute, e.g.
        ``dp_shard 24 x tp 4 + AC op + fp8 rowwise + compile`` (a pipeline's schedule after
        the degrees, unless 1F1B): shorter than
        ``Degrees.describe``'s line of them all, for the planner's tables."""
        parts = [f"{name} {getattr(self, name)}" for name in MESH_DIMS if getattr(self, name) > 1]
        line = " x ".join(parts) or "1 device"
        line += f" (ep {self.ep} within dp_shard)" if self.ep > 1 else ""
        line += f" + {self.pp_schedule}" if self.pp > 1 and self.pp_schedule != "1f1b" else ""
        mode = self.activation_checkpointing
        if mode == "budget":
            line += f" + AC budget {self.activation_memory_budget:g}"
        elif mode != "none":
            line += " + AC" if mode == "full" else f" + AC {mode}"
        line += f" + fp8 {self.fp8}" if self.fp8 is not None else ""
        return line + (" + compile" if self.compile else "")


def balanced_layer_split(num_layers: int, pp: int) -> tuple[int, ...] | None:
    """The planner's layers per stage when ``num_layers`` does not divide by ``pp`` (None when
    it does: the trainer's even split). The extra layers go to the middle stages first, then to
    the last: the first stage holds the embedding and the most micro-batches in flight under
    1F1B, the last the head and the logits (Llama 3's 405B run took one layer off each,
    Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2)."""
    base, extra = divmod(num_layers, pp)
    if extra == 0:
        return None
    order = [*range(1, pp - 1), pp - 1, 0]  # who takes the next extra layer
    split = [base] * pp
    for stage in order[:extra]:
        split[stage] += 1
    return tuple(split)


@functools.lru_cache(maxsize=CACHED)
def _even_split(num_layers: int, pp: int) -> tuple[int, ...]:
    return tuple(even_layer_split(num_layers, pp))


@functools.lru_cache(maxsize=CACHED)
def context_tokens(seq_len: int, cp: int) -> int:
    """The most tokens a context-parallel rank holds of one sequence (the trainer's split,
    ``context_local_lengths``)."""
    return max(context_local_lengths(seq_len, cp))


def problems(model: ModelConfig, layout: Layout, seq_len: int) -> list[str]:
    """Why goodput's trainer would refuse ``layout`` for ``model`` at ``seq_len`` (its own
    checks, ``ParallelConfig`` and ``resolve_degrees``, and their reason); empty if it takes
    it."""
    return list(_problems(model, layout, seq_len))


@functools.lru_cache(maxsize=CACHED)
def _problems(model: ModelConfig, layout: Layout, seq_len: int) -> tuple[str, ...]:
    # The config's own checks do not read the data-parallel degrees (the planner's layouts are
    # all data_parallel = 'fsdp'): asked once per shape; only resolve_degrees reads them.
    refused = _model_problem(model, replace(layout, dp_replicate=1, dp_shard=1), seq_len)
    if refused is not None:
        return (refused,)
    try:
        resolve_degrees(_config(layout), layout.product())
    except GoodputError as error:
        return (error.what,)
    return ()


@functools.lru_cache(maxsize=CACHED)
def _model_problem(model: ModelConfig, shape: Layout, seq_len: int) -> str | None:
    try:
        _config(shape).check_model(model, seq_len)
    except GoodputError as error:
        return error.what
    return None


def _config(layout: Layout) -> ParallelConfig:
    """``layout`` as the trainer's ``[parallel]`` (which checks it alone when built)."""
    keys: dict[str, Any] = layout.by_name()  # keyword arguments of the config
    keys["activation_checkpointing"] = layout.activation_checkpointing  # one of AC_MODES
    if layout.activation_checkpointing == "budget":
        keys["activation_memory_budget"] = layout.activation_memory_budget
    if layout.fp8 is not None:
        keys["fp8"] = layout.fp8
    if layout.pp > 1:
        keys["pp_schedule"] = layout.pp_schedule
        keys["pp_stages_per_rank"] = layout.stages_per_rank  # the planner's, checked
    return ParallelConfig(
        **keys,
        compile=layout.compile,
        pp_layers_per_stage=layout.pp_layers_per_stage,
    )


def tp_across_hosts(layout: Layout, nhosts: int, ppn: int) -> str | None:
    """The warning for a layout whose tensor-parallel groups span hosts (the trainer's refusal,
    ``check_tp_within_hosts``); None when they do not."""
    try:
        check_tp_within_hosts(layout.tp, nhosts * ppn, ppn)
    except GoodputError as error:
        return f"{error.what}; {error.fix} (goodput's trainer refuses it)"
    return None


def spans_hosts(layout: Layout, group: str, ppn: int) -> bool:
    """Whether ``layout``'s ``group`` (``tp``, ``cp``, ``ep``, ``fsdp``: dp_shard x cp,
    ``dp_replicate``, ``pp``) has ranks on more than one host. Ranks go in the mesh's order, tp
    fastest (``config.parallel.MESH_DIMS``), so a group spans the product of its own degree and
    every degree inside it; it stays on a host when that block fits in one."""
    inner = {
        "tp": layout.tp,
        "cp": layout.cp * layout.tp,
        "ep": layout.ep * layout.cp * layout.tp,
        "fsdp": layout.dp_shard * layout.cp * layout.tp,
        "dp_replicate": layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp,
        "pp": layout.product(),
    }[group]
    return inner > ppn or ppn % inner != 0
