"""Learning-rate schedules: a pure function of the step, keyed by the TOML ``kind``.

``warmup_cosine``: linear warmup to the peak, cosine decay to ``min_lr_ratio`` · peak.
``wsd`` (warmup-stable-decay): linear warmup, flat at the peak, then a linear decay over the
last ``decay_fraction`` of the run — so a run can be extended from any stable-phase checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from goodput.config import limits


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleConfig:
    kind: Literal["warmup_cosine", "wsd"] = "warmup_cosine"
    lr: float = field(default=3e-4, metadata=limits(above=0))
    warmup_steps: int = 100
    min_lr_ratio: float = field(default=0.1, metadata=limits(at_most=1))
    decay_fraction: float = field(default=0.2, metadata=limits(at_most=1))  # wsd only

    def inert_keys(self) -> dict[str, str]:
        """What another kind does not read (config.py refuses it when set)."""
        return {"decay_fraction": "kind = 'wsd'"} if self.kind != "wsd" else {}


def _warmup_cosine(cfg: ScheduleConfig, step: int, total_steps: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(total_steps - cfg.warmup_steps, 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _wsd(cfg: ScheduleConfig, step: int, total_steps: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_start = total_steps - int(cfg.decay_fraction * total_steps)
    if step < decay_start:
        return cfg.lr
    progress = (step - decay_start) / max(total_steps - decay_start, 1)
    return cfg.lr * (1 - (1 - cfg.min_lr_ratio) * min(progress, 1.0))


KINDS: dict[str, Callable[[ScheduleConfig, int, int], float]] = {
    "warmup_cosine": _warmup_cosine,
    "wsd": _wsd,
}


def learning_rate(cfg: ScheduleConfig, step: int, total_steps: int) -> float:
    """The LR for 0-based ``step`` of a ``total_steps`` run."""
    return KINDS[cfg.kind](cfg, step, total_steps)
