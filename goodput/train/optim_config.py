"""The ``[optim]`` table, torch-free (the optimizers it builds are ``optim.py``'s)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from goodput.config import limits


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimConfig:
    kind: Literal["adamw"] = "adamw"
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata=limits(below=1))
    eps: float = field(default=1e-8, metadata=limits(above=0))
    weight_decay: float = 0.1
