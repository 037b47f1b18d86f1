"""Learning-rate schedules: a pure function of the step, keyed by the TOML ``kind``.

``warmup_cosine``: linear warmup to the peak, cosine decay to ``min_lr_ratio`` · peak.
``wsd`` (warmup-stable-decay): linear warmup, flat at the peak, then a linear decay over the
last ``decay_fraction`` of the run — so a run can be extended from any stable-phase checkpoint.
Or the decay starts with a data-mix stage: ``decay_start = "stage:N"`` (N counts from 0, as the
``stage`` of ``metrics.jsonl`` does) decays from that stage's first step to the end, the anneal
of a run whose last stage is its high-quality mixture. The stage must exist (``RunConfig``
checks it at load through ``decay_start_step``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from goodput.config import limits
from goodput.errors import GoodputError

STAGE_START = re.compile(r"stage:([0-9]{1,4})")  # "stage:N" of [schedule] decay_start


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleConfig:
    kind: Literal["warmup_cosine", "wsd"] = "warmup_cosine"
    lr: float = field(default=3e-4, metadata=limits(above=0))
    warmup_steps: int = 100
    min_lr_ratio: float = field(default=0.1, metadata=limits(at_most=1))
    decay_fraction: float = field(default=0.2, metadata=limits(at_most=1))  # wsd only
    decay_start: str | None = None  # wsd only: "stage:N", the decay from stage N's start

    def __post_init__(self) -> None:
        if self.decay_start is not None and not STAGE_START.fullmatch(self.decay_start):
            raise GoodputError.usage(
                "[schedule]",
                f"decay_start {self.decay_start[:40]!r} is not of the form 'stage:N'",
                'write e.g. decay_start = "stage:2" (stages count from 0)',
            )

    def inert_keys(self) -> dict[str, str]:
        """What another kind does not read (config.py refuses it when set)."""
        if self.kind != "wsd":
            return {"decay_fraction": "kind = 'wsd'", "decay_start": "kind = 'wsd'"}
        if self.decay_start is not None:
            return {"decay_fraction": "decay_start unset"}
        return {}

    def decay_start_step(self, stage_steps: tuple[int, ...]) -> int | None:
        """The step the decay starts after when ``decay_start`` names one of the stages that
        start after ``stage_steps``; None when it names none."""
        if self.decay_start is None:
            return None
        match = STAGE_START.fullmatch(self.decay_start)
        assert match is not None  # __post_init__
        stage = int(match[1])
        if stage >= len(stage_steps):
            raise GoodputError.usage(
                "[schedule]",
                f"decay_start {self.decay_start!r} names a stage the run does not have (it has "
                f"{len(stage_steps)}, stage:0 to stage:{len(stage_steps) - 1})",
                "name one of them, or add the stage to [[data.stages]]",
            )
        return stage_steps[stage]


def _warmup_cosine(cfg: ScheduleConfig, step: int, total_steps: int, _: int | None) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(total_steps - cfg.warmup_steps, 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _wsd(cfg: ScheduleConfig, step: int, total_steps: int, decay_start: int | None) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if decay_start is None:
        decay_start = total_steps - int(cfg.decay_fraction * total_steps)
    if step < decay_start:
        return cfg.lr
    progress = (step - decay_start) / max(total_steps - decay_start, 1)
    return cfg.lr * (1 - (1 - cfg.min_lr_ratio) * min(progress, 1.0))


KINDS: dict[str, Callable[[ScheduleConfig, int, int, int | None], float]] = {
    "warmup_cosine": _warmup_cosine,
    "wsd": _wsd,
}


def learning_rate(
    cfg: ScheduleConfig, step: int, total_steps: int, decay_start: int | None = None
) -> float:
    """The LR for 0-based ``step`` of a ``total_steps`` run; ``decay_start``: the 0-based step
    a ``wsd`` decay starts at, when a stage sets it (``decay_start_step``)."""
    return KINDS[cfg.kind](cfg, step, total_steps, decay_start)
