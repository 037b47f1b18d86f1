"""The run config: one TOML file, one table per component, and the batch plan derived from it.

``[model]`` ``[train]`` ``[data]`` ``[optim]`` ``[schedule]`` ``[parallel]`` ``[checkpoint]``
``[diagnostics]`` ``[eval]`` (``goodput.eval.config``) ``[metrics]`` (``metrics.py``)
``[watch]`` (the straggler watch, ``monitor/stragglers.py``) ``[profile]`` (``profile.py``); each
component is built from its own table only. What can be derived is derived, never configured
twice: the global batch in samples is ``tokens_per_step / seq_len``, the
data-parallel size comes from the mesh (``mesh.py``), and gradient accumulation is
``global batch / (micro_batch_size · DP)``. Numbers that do not divide are a usage error naming
the values and a value that would work.

``[data]`` names the data as one file list or as data-mix stages (``[[data.stages]]``, exactly
one of the two): each stage a file list and the step it starts after, given as a step or as a
multiple of ``tokens_per_step``; the first at 0, each after the one before and before the
run's end (``RunConfig.stage_steps``), at most the blend's ``MAX_STAGES``. ``[schedule]
decay_start`` may name one of them.

Deprecated keys, read for one more release with a one-line warning: ``[train]
activation_checkpointing`` and ``[train] compile`` (now in ``[parallel]``) and ``[train] output``
(now ``[train] run_dir``, by ``TrainConfig.RENAMED``: see ``goodput.config``); the built config
holds them in their new place only.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from goodput.checkpoint.config import CheckpointConfig
from goodput.config import NON_EMPTY, example, limits, one_of
from goodput.data.interleave import MAX_SAMPLES
from goodput.data.stages import MAX_STAGES
from goodput.errors import GoodputError
from goodput.eval.config import EvalConfig
from goodput.train.config.metrics import MetricsConfig
from goodput.train.config.model import ModelConfig
from goodput.train.config.optim import OptimConfig
from goodput.train.config.parallel import (
    ParallelConfig,
    check_tp_within_hosts,
    pipeline_microbatches,
    resolve_degrees,
)
from goodput.train.config.profile import ProfilerConfig
from goodput.train.config.schedule import ScheduleConfig

POSITIVE = limits(at_least=1)
FILE_LIST_EXAMPLE = "PATH (your corpora, see docs/data.md)"
STAGES_EXAMPLE = '[{file_list="PATH", start_step=0}, ...] (see docs/training.md)'
# [diagnostics] loss_spike_window (monitor/loss_spikes.py):
MIN_HISTORY = 20  # finite losses before the first z; the floor of [diagnostics] loss_spike_window
MAX_WINDOW = 2**16  # bounds the saved state a checkpoint may hand back


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    steps: int = field(metadata=POSITIVE)
    tokens_per_step: int = field(metadata=POSITIVE)  # the global batch, in tokens
    seq_len: int = field(metadata=POSITIVE)
    micro_batch_size: int = field(metadata=POSITIVE)  # samples per forward pass on one rank
    # The run directory: new, empty, or a goodput run directory (build.require_run_dir).
    run_dir: str = field(metadata={**NON_EMPTY, **example("runs/NAME")})
    # inf: no clipping
    max_grad_norm: float = field(default=1.0, metadata=limits(above=0, inf_ok=True))
    # Steps skipped in a row for a non-finite gradient norm before the run stops (step.py).
    max_skipped_steps: int = field(default=5, metadata=POSITIVE)
    # model init; data order comes from [data] seed. Every rank seeds numpy's global RNG with
    # it, which takes 32 bits.
    seed: int = field(
        default=0, metadata=limits(at_most=2**32 - 1, why="numpy's global seed takes 32 bits")
    )
    # Deprecated: [parallel] activation_checkpointing and compile; moved there by RunConfig.
    activation_checkpointing: bool | None = None
    compile: bool | None = None
    # per device, for MFU; None: the device table or a CPU probe
    peak_tflops: float | None = field(default=None, metadata=limits(above=0))
    tensorboard: bool = True  # also write TensorBoard events when tensorboard is installed

    RENAMED: ClassVar[Mapping[str, str]] = {"output": "run_dir"}  # config.read_renamed

    def __post_init__(self) -> None:
        if self.tokens_per_step % self.seq_len:
            raise GoodputError.usage(
                "[train]",
                f"tokens_per_step {self.tokens_per_step} is not a multiple of seq_len "
                f"{self.seq_len}",
                f"use e.g. tokens_per_step = {_round_up(self.tokens_per_step, self.seq_len)}",
            )
        plan_batches(self, dp_size=1)  # what no world size can mend: refused now, not at start
        samples = self.steps * (self.tokens_per_step // self.seq_len)
        if samples > MAX_SAMPLES:  # the blend of the whole run could not be built
            raise GoodputError.usage(
                "[train]",
                f"steps {self.steps} x {self.tokens_per_step // self.seq_len} samples per step "
                f"= {samples:,} samples, more than a blend holds ({MAX_SAMPLES:,})",
                "lower train.steps or train.tokens_per_step",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class StageConfig:
    """One ``[[data.stages]]`` table: a mixture (its file list) and the step it starts after
    (its samples are those of the next step on), given as a step or as the tokens trained on
    before it (a multiple of ``train.tokens_per_step``)."""

    file_list: str = field(metadata={**NON_EMPTY, **example("PATH")})
    start_step: int | None = field(
        default=None, metadata={**one_of("start_tokens"), **example("N")}
    )
    start_tokens: int | None = field(
        default=None, metadata={**one_of("start_step"), **example("N")}
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class DataConfig:
    # "weight path-prefix corpus" lines, as for `goodput data blend`. The one key a shipped
    # recipe (configs/) leaves to its user: without it, the error names the override to add.
    file_list: str | None = field(
        default=None, metadata={**NON_EMPTY, **example(FILE_LIST_EXAMPLE), **one_of("stages")}
    )
    # Data-mix stages instead: each its own file list from its start on (RunConfig checks the
    # starts against [train]).
    stages: tuple[StageConfig, ...] | None = field(
        default=None, metadata={**one_of("file_list"), **example(STAGES_EXAMPLE)}
    )
    seed: int = 1234  # the blend's sample order
    cache: str = field(default="blend-cache", metadata=NON_EMPTY)  # blends built once, reused
    on_exhausted: Literal["repeat", "error"] = "repeat"

    def __post_init__(self) -> None:
        if (self.file_list is None) == (self.stages is None):  # built in code, not from TOML
            raise GoodputError.usage(
                "[data]", "set exactly one of file_list and stages", "drop one, or add one"
            )
        if self.stages is not None and not 1 <= len(self.stages) <= MAX_STAGES:
            raise GoodputError.usage(
                "[data]",
                f"stages holds {len(self.stages)} stages",
                f"give 1 to {MAX_STAGES} [[data.stages]] tables",
            )

    def file_lists(self) -> tuple[str, ...]:
        """The file list of each stage, in order (one, without stages)."""
        if self.stages is None:
            assert self.file_list is not None  # one_of: the loader saw to it
            return (self.file_list,)
        return tuple(stage.file_list for stage in self.stages)


@dataclass(frozen=True, slots=True, kw_only=True)
class DiagnosticsConfig:
    """The in-loop diagnostics (``monitor/diagnostics.py``); each costs well under 1% of a step."""

    # steps between bf16 freeze checks (updates that round to zero); 0: off
    freeze_check_interval: int = field(default=100, metadata=limits(at_least=0))
    # a tensor is frozen when more than this share of its entries' updates rounded away
    freeze_threshold: float = field(default=0.5, metadata=limits(above=0, below=1))
    # loss spikes: the robust z-score of the loss against this many previous steps (at least
    # the history a z-score needs; at most what a checkpoint's state may hold)
    loss_spike_window: int = field(
        default=100,
        metadata=limits(
            at_least=MIN_HISTORY,
            at_most=MAX_WINDOW,
            why=f"a z-score needs {MIN_HISTORY} losses; a checkpoint keeps at most {MAX_WINDOW}",
        ),
    )
    loss_spike_z: float = field(default=6.0, metadata=limits(above=0))
    # the gradient noise scale's smoothing (an EMA of each of its two estimates)
    gns_ema: float = field(default=0.99, metadata=limits(above=0, below=1))

    def inert_keys(self) -> dict[str, str]:
        """What does nothing with its diagnostic off (config.py refuses it when set)."""
        if self.freeze_check_interval:
            return {}
        return {"freeze_threshold": "freeze_check_interval > 0"}


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchConfig:
    """``[watch]``: the straggler watch (``stragglers.py``), the same on every rank. A rank whose
    mean busy time over a window of ``straggler_steps`` steps exceeds ``straggler_ratio`` times
    the mean of the steps' medians is named in one warning line."""

    straggler_ratio: float = field(
        default=1.2,
        metadata=limits(
            above=1,
            at_most=100,
            why="at 1 every rank lags the median; 100 times slower is a hang, the watchdog's case",
        ),
    )
    straggler_steps: int = field(
        default=20,
        metadata=limits(
            at_least=2,
            at_most=10_000,
            why="one step is noise; a longer window names a straggler too late to act on",
        ),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    profile: ProfilerConfig = field(default_factory=ProfilerConfig)  # profile.py

    def __post_init__(self) -> None:
        self._move_deprecated_keys()
        if self.train.seq_len > self.model.max_seq_len:
            raise GoodputError.usage(
                "[train]",
                f"seq_len {self.train.seq_len} exceeds model.max_seq_len {self.model.max_seq_len}",
                "lower train.seq_len or raise model.max_seq_len",
            )
        if self.optim.qk_clip is not None and self.parallel.cp > 1:
            raise GoodputError.usage(
                "[optim]",
                "qk_clip needs every key of a sequence on one rank; parallel.cp splits them",
                "drop optim.qk_clip or set parallel.cp = 1",
            )
        self.parallel.check_model(self.model, self.train.seq_len)
        self.stage_steps()  # the starts, checked against [train] now, not at the stage
        self.schedule.decay_start_step(self.stage_steps())

    def stage_steps(self) -> tuple[int, ...]:
        """The step each data-mix stage starts after (0 for the first): a stage's samples are
        those of steps ``start + 1`` on. ``(0,)`` without stages."""
        if self.data.stages is None:
            return (0,)
        starts = tuple(
            _start_step(stage, i, self.train.tokens_per_step)
            for i, stage in enumerate(self.data.stages)
        )
        for i, start in enumerate(starts):
            where = f"data.stages[{i}]"
            if i == 0 and start != 0:
                raise GoodputError.usage(
                    "[data]", f"{where} starts at step {start}", "start the first stage at 0"
                )
            if i and start <= starts[i - 1]:
                raise GoodputError.usage(
                    "[data]",
                    f"{where} starts at step {start}, not after data.stages[{i - 1}] "
                    f"(step {starts[i - 1]})",
                    "list the stages in the order they start, each at a later step",
                )
            if start >= self.train.steps:
                raise GoodputError.usage(
                    "[data]",
                    f"{where} starts at step {start}, not before the run's end "
                    f"(train.steps {self.train.steps})",
                    "start it earlier, raise train.steps, or drop the stage",
                )
        return starts

    def shortened(self, steps: int) -> RunConfig:
        """This run cut to ``steps`` steps (a diagnostic's), with the data-mix stages that start
        before its end (each from its step) and a decay tied to one of them; a decay tied to a
        stage left out starts after the end, so it is left out too."""
        starts = self.stage_steps()
        data, schedule = self.data, self.schedule
        if data.stages is not None:
            kept = [
                StageConfig(file_list=stage.file_list, start_step=start)
                for stage, start in zip(data.stages, starts, strict=True)
                if start < steps
            ]
            data = replace(data, stages=tuple(kept))
        decay_start = schedule.decay_start_step(starts)
        if decay_start is not None and decay_start >= steps:
            schedule = replace(schedule, decay_start=None)
        return replace(self, train=replace(self.train, steps=steps), data=data, schedule=schedule)

    def _move_deprecated_keys(self) -> None:
        moved = {
            key: value
            for key in DEPRECATED_TRAIN_KEYS
            if (value := getattr(self.train, key)) is not None
        }
        renamed_values = ParallelConfig.RENAMED_VALUES
        moved = {key: renamed_values.get(key, {}).get(value, value) for key, value in moved.items()}
        for key, value in moved.items():
            default = ParallelConfig.__dataclass_fields__[key].default
            if getattr(self.parallel, key) not in (value, default):
                raise GoodputError.usage(
                    "[train]",
                    f"{key} is set in both [train] and [parallel], differently",
                    f"set it in [parallel] only ([train] {key} is deprecated)",
                )
            print(
                f"goodput: warning: [train] {key} is deprecated; set it in [parallel] (the "
                "[train] key is read until the next release)",
                file=sys.stderr,
                flush=True,
            )
        if moved:
            # Frozen: built once, here, before anyone can see it.
            object.__setattr__(self, "parallel", replace(self.parallel, **moved))
            cleared = replace(self.train, activation_checkpointing=None, compile=None)
            object.__setattr__(self, "train", cleared)


DEPRECATED_TRAIN_KEYS = ("activation_checkpointing", "compile")  # now in [parallel]


def _start_step(stage: StageConfig, index: int, tokens_per_step: int) -> int:
    """The step ``stage`` starts after: its ``start_step``, or its ``start_tokens`` in steps."""
    if stage.start_tokens is None:
        assert stage.start_step is not None  # one_of: the loader saw to it
        return stage.start_step
    steps, rest = divmod(stage.start_tokens, tokens_per_step)
    if rest:
        below, above = steps * tokens_per_step, (steps + 1) * tokens_per_step
        raise GoodputError.usage(
            "[data]",
            f"data.stages[{index}].start_tokens {stage.start_tokens} is not a multiple of "
            f"train.tokens_per_step {tokens_per_step}: a stage starts on a step",
            f"use {below} or {above}",
        )
    return steps


@dataclass(frozen=True, slots=True)
class BatchPlan:
    global_batch_size: int  # samples per optimizer step, all ranks together
    micro_batch_size: int
    dp_size: int
    grad_accumulation: int  # micro-batches per rank per step

    @property
    def local_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accumulation


def plan_batches(train: TrainConfig, dp_size: int) -> BatchPlan:
    """Derive the global batch and gradient accumulation on ``dp_size`` data-parallel ranks
    (``ParallelMesh.dp_size``); fail clearly when they do not divide."""
    global_batch = train.tokens_per_step // train.seq_len
    per_round = train.micro_batch_size * dp_size
    if global_batch % per_round:
        raise GoodputError.usage(
            "[train]",
            f"the global batch of {global_batch} samples (tokens_per_step "
            f"{train.tokens_per_step} / seq_len {train.seq_len}) does not split into micro-batches "
            f"of {train.micro_batch_size} on {dp_size} data-parallel ranks",
            f"use a multiple of {per_round * train.seq_len} for tokens_per_step, e.g. "
            f"{_round_up(train.tokens_per_step, per_round * train.seq_len)}, or change "
            "micro_batch_size",
        )
    return BatchPlan(global_batch, train.micro_batch_size, dp_size, global_batch // per_round)


def check_world(cfg: RunConfig, num_ranks: int, ranks_per_host: int) -> BatchPlan:
    """What the trainer refuses of ``cfg`` on ``num_ranks`` ranks (``ranks_per_host`` to a host)
    before it builds anything, without torch: the layout on the world size, tensor parallelism
    within a host, the batch plan and the pipeline's micro-batches (``goodput submit`` checks a
    chain's config with it, ``goodput chaos`` a campaign's, tests each recipe's)."""
    degrees = resolve_degrees(cfg.parallel, num_ranks)
    check_tp_within_hosts(degrees.tp, num_ranks, ranks_per_host)
    plan = plan_batches(cfg.train, dp_size=degrees.dp)
    if degrees.pp > 1:
        pipeline_microbatches(cfg.parallel, plan.local_batch_size, plan.grad_accumulation)
    return plan


def _round_up(value: int, multiple: int) -> int:
    return math.ceil(value / multiple) * multiple
