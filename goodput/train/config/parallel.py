"""The ``[parallel]`` table and the rules a layout must meet, with no torch.

``ParallelConfig`` holds the degrees and options of ``[parallel]`` and refuses, in one line each,
what cannot work: alone (``__post_init__``) and for a model and sequence length
(``check_model``). ``resolve_degrees`` fills the unset data-parallel degree from the world size
and checks the product; ``check_tp_within_hosts`` keeps tensor-parallel groups on one host;
``context_chunk_bounds`` is the context-parallel split of a sequence, ``even_layer_split`` the
pipeline's default split of the layers, ``fsdp_shards`` when FSDP is applied (what each
precision policy means is ``precision.py``'s). They are the trainer's rules (``mesh.py`` and
``parallelize.py`` apply them) and the planner's (``goodput.plan``, which runs on login nodes:
nothing here imports torch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal

from goodput.config import limits
from goodput.errors import GoodputError
from goodput.train.config.model import ModelConfig
from goodput.train.config.precision import PRECISIONS

DEGREE = limits(at_least=1, at_most=2**20)
PIPELINE_KEYS = ("pp_schedule", "pp_microbatches", "pp_stages_per_rank", "pp_layers_per_stage")
FSDP_KEYS = ("reshard_after_forward", "sync_every_micro_batch")
# The zero-bubble schedules: each backward split in two, the inputs' gradients first (to the
# stage before) and the weights' later, into what would be the pipeline's bubble.
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")
# Each pipeline schedule (pipeline.py runs torch's class of that kind) and where it puts a
# pipeline rank r's stages: "single" stage r; "looped" stages r, r + pp, r + 2 pp, ...; "v" two
# stages, r and 2 pp - 1 - r, so that the first and the last stage share rank 0.
SCHEDULE_PLACEMENT: dict[str, Literal["single", "looped", "v"]] = {
    "gpipe": "single",
    "1f1b": "single",
    "interleaved_1f1b": "looped",
    "interleaved_zb": "looped",
    "zbv": "v",
    "dualpipev": "v",
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
    # Tensor parallelism: cross-entropy on the vocabulary shards, never gathering the logits.
    loss_parallel: bool = True
    # Pipeline parallelism (pipeline.py): the schedule (SCHEDULE_PLACEMENT); micro-batches per
    # step on each pipeline (None: the batch plan's micro-batches per rank); stages per rank
    # (None: 1, and 2 for the schedules that run several); layers per stage in stage order
    # (None: an even split, the first stages taking one more when they do not divide).
    pp_schedule: Literal[
        "gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"
    ] = "1f1b"
    pp_microbatches: int | None = field(default=None, metadata=DEGREE)
    pp_stages_per_rank: int | None = field(default=None, metadata=DEGREE)
    pp_layers_per_stage: tuple[int, ...] | None = field(default=None, metadata=DEGREE)
    reshard_after_forward: bool = True
    precision: Literal["fp32-master", "pure-bf16", "fp32"] = "fp32-master"  # PRECISIONS' names
    # What each block keeps for backward (train/parallel/activation_checkpoint.py): "none"
    # everything; "full" its input only, recomputing the block; "op" the outputs of its matmuls
    # and attention, recomputing the rest; "budget" what torch.compile's partitioner fits in
    # activation_memory_budget (needs compile).
    activation_checkpointing: Literal["none", "full", "op", "budget"] = "none"
    # "budget": the share of a block's activations kept, the rest recomputed (0 recomputes all,
    # as "full"; 1 none, as "none").
    activation_memory_budget: float = field(
        default=0.5, metadata=limits(above=0, below=1, why="0 is 'full' and 1 is 'none'")
    )
    compile: bool = False  # torch.compile each block
    # FP8 matmuls for the blocks' linear layers through torchao (train/parallel/float8.py):
    # the scaling recipe; None trains without.
    fp8: Literal["rowwise", "tensorwise"] | None = None
    # torchao's emulation of the FP8 matmuls, for devices without them (tests, on CPU).
    fp8_emulate: bool = False
    # FSDP: reduce-scatter gradients after every micro-batch, keeping only sharded gradients;
    # false: once per step, holding unsharded gradients across the accumulation (memory for
    # communication, bench_train).
    sync_every_micro_batch: bool = False

    # Spellings of a value still read for one release (config.read_renamed_values).
    RENAMED_VALUES: ClassVar[Mapping[str, Mapping[object, str]]] = {
        "activation_checkpointing": {False: "none", True: "full"}
    }

    def __post_init__(self) -> None:
        if self.ep > 1 and self.data_parallel == "replicate":
            # The ranks holding the same experts sum their gradients through FSDP.
            raise GoodputError.usage(
                "[parallel]",
                f"ep = {self.ep} needs data_parallel = 'fsdp'",
                "use data_parallel = 'fsdp' (the default) with expert parallelism",
            )
        # fp32-master's bf16 compute comes from FSDP's mixed-precision policy; a replicated model
        # has no such hook and would silently train in fp32.
        if self.data_parallel == "replicate" and PRECISIONS[self.precision].mixed:
            raise GoodputError.usage(
                "[parallel]",
                f"precision '{self.precision}' needs data_parallel = 'fsdp'",
                "use data_parallel = 'fsdp', or precision 'fp32' or 'pure-bf16' with 'replicate'",
            )
        if self.activation_checkpointing == "op" and self.ep > 1:
            # Split experts are an FSDP unit inside the block: FSDP's hooks run a different
            # number of ops in forward and in the recompute, and torch 2.13's per-op replay
            # fails on the first extra one (pytorch/torchtitan#3427; the fix is PyTorch's
            # pytorch/pytorch#196862). Seen here in tests/unit/train/test_layout_invariance.py.
            raise GoodputError.usage(
                "[parallel]",
                f"activation_checkpointing = 'op' with ep = {self.ep}: torch 2.13's per-op "
                "recompute fails on FSDP's expert all-gathers inside the block (torchtitan#3427)",
                "use activation_checkpointing = 'full' with expert parallelism",
            )
        if self.activation_checkpointing == "budget" and not self.compile:
            raise GoodputError.usage(
                "[parallel]",
                "activation_checkpointing = 'budget' needs compile = true (the budget is "
                "torch.compile's partitioner's)",
                "set compile = true, or activation_checkpointing = 'op' without compile",
            )
        if self.data_parallel == "replicate" and (self.dp_shard or 1) > 1:
            raise GoodputError.usage(
                "[parallel]",
                f"dp_shard = {self.dp_shard}, but data_parallel = 'replicate' shards nothing",
                "leave dp_shard unset, or use data_parallel = 'fsdp'",
            )
        if self.pp > 1:  # with pp = 1 the pipeline keys are refused as inert (inert_keys)
            self._check_pipeline()

    def inert_keys(self) -> dict[str, str]:
        """The keys that do nothing in this layout, and what would enable each (config.py
        refuses them when set)."""
        rules: dict[str, str] = {}
        if self.pp == 1:
            rules |= dict.fromkeys(PIPELINE_KEYS, "pp > 1")
        if self.tp == 1:
            rules["loss_parallel"] = "tp > 1"
        if self.data_parallel == "replicate":  # FSDP's own options
            rules |= dict.fromkeys(FSDP_KEYS, "data_parallel = 'fsdp'")
        if self.activation_checkpointing != "budget":
            rules["activation_memory_budget"] = "activation_checkpointing = 'budget'"
        if self.fp8 is None:
            rules["fp8_emulate"] = "fp8 = 'rowwise' or 'tensorwise'"
        return rules

    def _check_pipeline(self) -> None:
        placement = SCHEDULE_PLACEMENT[self.pp_schedule]
        schedule = f"pp_schedule '{self.pp_schedule}'"
        if placement == "looped" and self.stages_per_rank < 2:
            raise GoodputError.usage(
                "[parallel]",
                f"{schedule} needs pp_stages_per_rank >= 2",
                "raise pp_stages_per_rank, or use pp_schedule '1f1b' or 'gpipe'",
            )
        if placement == "v" and self.stages_per_rank != 2:
            raise GoodputError.usage(
                "[parallel]",
                f"{schedule} places exactly 2 stages on each rank (a V: stages r and "
                f"2 pp - 1 - r), not pp_stages_per_rank = {self.stages_per_rank}",
                "leave pp_stages_per_rank unset (2), or use pp_schedule 'interleaved_zb' for more",
            )
        if placement == "single" and self.stages_per_rank != 1:
            raise GoodputError.usage(
                "[parallel]",
                f"pp_stages_per_rank = {self.stages_per_rank} needs pp_schedule 'interleaved_1f1b' "
                f"or 'interleaved_zb' (several stages per rank), not '{self.pp_schedule}'",
                f"set pp_schedule = 'interleaved_1f1b', or pp_stages_per_rank = 1 with "
                f"'{self.pp_schedule}'",
            )
        if self.pp_schedule in SPLIT_BACKWARD:
            self._check_split_backward()
        if self.pp_layers_per_stage is not None and len(self.pp_layers_per_stage) != (
            self.num_stages
        ):
            raise GoodputError.usage(
                "[parallel]",
                f"pp_layers_per_stage lists {len(self.pp_layers_per_stage)} stages, but pp "
                f"{self.pp} x pp_stages_per_rank {self.stages_per_rank} = {self.num_stages}",
                f"list {self.num_stages} layer counts, or leave it unset for an even split",
            )

    def _check_split_backward(self) -> None:
        """What a zero-bubble schedule's split backward (the inputs' gradients first, the
        weights' later, through the autograd graph kept between) does not run with in torch
        2.13, each seen to fail here (docs/parallel.md)."""
        schedule = f"pp_schedule '{self.pp_schedule}'"
        if self.compile:
            # The compiled backward is one autograd node that frees its buffers on its one run
            # ("non-empty donated buffers requires retain_graph=False").
            raise GoodputError.usage(
                "[parallel]",
                f"{schedule} with compile = true: torch 2.13's split backward cannot run a "
                "compiled block's backward in two parts (pytorch/pytorch#161904)",
                "set compile = false, or use pp_schedule '1f1b' or 'interleaved_1f1b' to compile",
            )
        if self.activation_checkpointing == "op":
            raise GoodputError.usage(
                "[parallel]",
                f"{schedule} with activation_checkpointing = 'op': torch 2.13's selective "
                'recompute takes one backward through a block, its split backward two ("Trying '
                'to backward an extra time")',
                "use activation_checkpointing = 'full', or 'op' with pp_schedule '1f1b'",
            )

    @property
    def stages_per_rank(self) -> int:
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return default_stages_per_rank(self.pp_schedule)

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def check_model(self, model: ModelConfig, seq_len: int) -> None:
        """Refuse a layout that cannot split ``model`` (a usage error naming what to change)."""
        if self.ep > 1:
            if model.moe is None:
                raise GoodputError.usage(
                    "[parallel]",
                    f"ep = {self.ep} needs a mixture-of-experts model (a [model.moe] table)",
                    "set ep = 1 for a dense model",
                )
            elif model.moe.num_experts % self.ep:
                raise GoodputError.usage(
                    "[parallel]",
                    f"ep = {self.ep} does not divide model.moe.num_experts = "
                    f"{model.moe.num_experts}",
                    "choose ep dividing the number of experts",
                )
        if self.cp > 1:
            self._check_context(seq_len, moe=model.moe is not None)
        if self.fp8 is not None:
            self._check_fp8(model)
        if self.tp > 1:
            split = {
                "model.num_heads": model.num_heads,
                "model.num_kv_heads": model.kv_heads,
                "model.vocab_size": model.vocab_size,
            }
            if model.moe is None:  # an MoE layer's weights are not split over tp
                split["model.ffn_dim"] = model.mlp_dim
            if self.cp == 1:  # sequence parallelism splits each micro-batch's sequence
                split["train.seq_len"] = seq_len
            for name, value in split.items():
                if value % self.tp:
                    raise GoodputError.usage(
                        "[parallel]",
                        f"tp = {self.tp} does not divide {name} = {value}",
                        f"choose tp dividing {name}, or change {name}",
                    )
        if self.pp > 1:
            layers = self.pp_layers_per_stage
            if layers is not None and sum(layers) != model.num_layers:
                raise GoodputError.usage(
                    "[parallel]",
                    f"pp_layers_per_stage sums to {sum(layers)} layers, but model.num_layers = "
                    f"{model.num_layers}",
                    "make the counts add up to model.num_layers",
                )
            if layers is None and self.num_stages > model.num_layers:
                raise GoodputError.usage(
                    "[parallel]",
                    f"{self.num_stages} pipeline stages for {model.num_layers} layers",
                    "lower pp or pp_stages_per_rank to at most model.num_layers stages",
                )

    def _check_fp8(self, model: ModelConfig) -> None:
        """FP8 matmuls (torch's ``_scaled_mm``) need both dimensions of each converted weight
        (train/parallel/float8.py) to be multiples of 16 on every rank: the model's width whole,
        the heads and the feed-forward split by tp."""
        head_dim = model.head_dim
        dims = {"model.dim": (model.dim, 1)}
        if model.moe is None:
            dims["model.ffn_dim"] = (model.mlp_dim, self.tp)
        elif model.moe.shared_expert:  # the routed experts are not converted
            dims["model.moe.expert_ffn_dim"] = (model.moe.expert_ffn_dim, 1)
        dims["model.num_heads x head dim"] = (model.num_heads * head_dim, self.tp)
        dims["model.num_kv_heads x head dim"] = (model.kv_heads * head_dim, self.tp)
        for name, (value, split) in dims.items():
            if value % (16 * split):
                per_rank = f" / tp {split}" if split > 1 else ""
                raise GoodputError.usage(
                    "[parallel]",
                    f"fp8 = '{self.fp8}': {name} = {value}{per_rank} is not a multiple of 16, "
                    "as FP8 matmuls need",
                    f"make {name} a multiple of {16 * split}, or leave fp8 unset",
                )

    def _check_context(self, seq_len: int, *, moe: bool) -> None:
        """Each rank's two chunks of a sequence must be non-empty and, under tensor
        parallelism, split evenly over the tp ranks (sequence parallelism); an MoE model's
        ranks hold equally many tokens (its layers gather every rank's routing alike)."""
        fix = f"use a train.seq_len that is a multiple of 2 x cp x tp = {2 * self.cp * self.tp}"
        if moe and seq_len % (2 * self.cp):
            raise GoodputError.usage(
                "[parallel]",
                f"cp = {self.cp} with a mixture-of-experts model needs train.seq_len = {seq_len} "
                f"to split into {2 * self.cp} equal chunks (each MoE layer gathers every "
                "context-parallel rank's routing, token for token)",
                fix,
            )
        if seq_len < 2 * self.cp:
            raise GoodputError.usage(
                "[parallel]",
                f"cp = {self.cp} splits each sequence into {2 * self.cp} chunks, more than "
                f"train.seq_len = {seq_len} tokens",
                fix,
            )
        lengths = set(context_local_lengths(seq_len, self.cp))
        if self.tp > 1 and any(length % self.tp for length in lengths):
            raise GoodputError.usage(
                "[parallel]",
                f"tp = {self.tp} does not divide the {sorted(lengths)} tokens a context-parallel "
                f"rank holds of train.seq_len = {seq_len}",
                fix,
            )


# The layout's dimensions, outermost first: tp varies fastest (see Rank order above).
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True, slots=True, kw_only=True)
class Degrees:
    """A layout's six degrees, resolved (1: that dimension is not split); the planner's
    ``plan.layout.Layout`` is one too."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # splits the routed experts over ranks of dp_shard

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own share of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def expert_shard(self) -> int:
        """The ``dp_shard`` ranks holding the same experts (``ep`` splits the rest)."""
        return self.dp_shard // self.ep

    def describe(self) -> str:
        """The degrees as the mesh orders them, e.g. ``pp 2 x dp_replicate 1 x dp_shard 2 x
        cp 1 x tp 1``, and ``ep`` when it splits ``dp_shard``."""
        line = " x ".join(f"{name} {getattr(self, name)}" for name in MESH_DIMS)
        return line + (f" (ep {self.ep} within dp_shard)" if self.ep > 1 else "")

    def product(self) -> int:
        """The number of ranks this layout needs (``ep`` borrows its ranks)."""
        return self.dp * self.tp * self.pp * self.cp

    def by_name(self) -> dict[str, int]:
        """The six degrees by their ``[parallel]`` names, in the order of the fields."""
        return {degree.name: getattr(self, degree.name) for degree in fields(Degrees)}


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
    if degrees.dp_shard % cfg.ep:
        raise GoodputError.usage(
            "[parallel]",
            f"ep = {cfg.ep} does not divide dp_shard = {degrees.dp_shard}: expert parallelism "
            "splits the experts over ranks that shard one replica",
            f"choose ep dividing {degrees.dp_shard} (e.g. ep = "
            f"{math.gcd(cfg.ep, degrees.dp_shard)}), or raise dp_shard",
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


def check_tp_within_hosts(tp: int, world_size: int, ranks_per_host: int) -> None:
    """Refuse a tensor-parallel group that the rank order would split across hosts."""
    if tp == 1 or world_size <= ranks_per_host or ranks_per_host % tp == 0:
        return
    raise GoodputError.usage(
        "[parallel]",
        f"tp = {tp} does not divide the {ranks_per_host} ranks per host: a tensor-parallel "
        "group would span hosts, with an all-reduce inside every layer over the network",
        f"choose tp dividing {ranks_per_host} (e.g. tp = {math.gcd(tp, ranks_per_host)}) and "
        "split the rest with pp or dp",
    )


def context_chunk_bounds(seq_len: int, cp: int) -> list[tuple[int, int]]:
    """[start, end) of the 2cp near-even chunks context parallelism cuts a sequence into (the
    first seq_len % 2cp one token longer); rank r holds chunks r and 2cp-1-r."""
    base, longer = divmod(seq_len, 2 * cp)
    ends = [(i + 1) * base + min(i + 1, longer) for i in range(2 * cp)]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def context_local_lengths(seq_len: int, cp: int) -> list[int]:
    """The tokens each context-parallel rank holds of one sequence, by rank."""
    lengths = [end - start for start, end in context_chunk_bounds(seq_len, cp)]
    return [lengths[rank] + lengths[2 * cp - 1 - rank] for rank in range(cp)]


def even_layer_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per pipeline stage when ``pp_layers_per_stage`` is unset: an even split, the
    first ``num_layers % num_stages`` stages taking one more."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (stage < extra) for stage in range(num_stages)]


def default_stages_per_rank(schedule: str) -> int:
    """The stages a rank runs under ``schedule`` when ``pp_stages_per_rank`` is unset."""
    return 1 if SCHEDULE_PLACEMENT[schedule] == "single" else 2


def rank_stages(schedule: str, pp: int, stages_per_rank: int, pp_rank: int) -> list[int]:
    """The pipeline stages rank ``pp_rank`` of the pipeline runs, in stage order, as
    ``schedule`` places them (``SCHEDULE_PLACEMENT``); the planner's too."""
    num_stages = pp * stages_per_rank
    if SCHEDULE_PLACEMENT[schedule] == "v":
        return [pp_rank, num_stages - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp))


def fsdp_shards(num_ranks: int, precision: str) -> bool:
    """Whether goodput applies FSDP over ``num_ranks`` ranks (dp_replicate x dp_shard x cp):
    on one rank it shards nothing, yet its hooks cost ~12% of a CPU step (bench_train), so only
    a mixed policy (fp32-master), whose bf16 compute comes from FSDP's policy, takes it there."""
    return num_ranks > 1 or PRECISIONS[precision].mixed


def pipeline_microbatches(cfg: ParallelConfig, local_batch_size: int, default: int) -> int:
    """The pipeline's micro-batches per step: ``pp_microbatches``, else ``default`` (the batch
    plan's); refused unless it divides this rank's ``local_batch_size`` samples and the schedule
    takes it (torch's rules: 1F1B at least ``pp``; the interleaved schedules whole rounds of
    about ``pp``; DualPipeV at least one per stage, 2 ``pp``), so that the loop can refuse it at
    start rather than ``_schedule`` after the blend is built."""
    count = cfg.pp_microbatches or default
    if local_batch_size % count:
        raise GoodputError.usage(
            "[parallel]",
            f"pp_microbatches = {count} does not divide the {local_batch_size} samples each "
            "pipeline runs per step",
            "choose pp_microbatches dividing it, or leave it unset (one per micro-batch)",
        )
    rounds = max(1, count // cfg.pp)
    needs = None
    if cfg.pp_schedule == "1f1b" and count < cfg.pp:
        needs = f"at least pp = {cfg.pp}"
    elif cfg.pp_schedule in ("interleaved_1f1b", "interleaved_zb") and count % rounds:
        needs = f"a multiple of its {rounds} rounds (micro-batches // pp)"
    elif cfg.pp_schedule == "dualpipev" and count < cfg.num_stages:
        needs = f"at least one per stage, 2 x pp = {cfg.num_stages}"
    if needs is not None:
        least = cfg.num_stages if cfg.pp_schedule == "dualpipev" else cfg.pp
        raise GoodputError.usage(
            "[parallel]",
            f"pp_schedule '{cfg.pp_schedule}' with {count} micro-batches on pp = {cfg.pp}: it "
            f"needs {needs}",
            f"set parallel.pp_microbatches to a multiple of pp (and at least {least})",
        )
    return count
