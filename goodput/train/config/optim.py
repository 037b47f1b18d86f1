"""The ``[optim]`` table, torch-free (the optimizers it builds are ``optim/optimizers.py``'s).

One table for every kind: ``betas``, ``eps`` and ``weight_decay`` are AdamW's, and also LAMB's,
SophiaG's (``betas`` = (momentum, Hessian EMA); not ``eps``) and those of the AdamW that Muon and
Mano run on the parameters that are not hidden matrices. The keys of one kind only are named
after it (``KIND_KEYS``); one set with another kind is refused, naming the kind it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from goodput.config import limits
from goodput.errors import GoodputError

OptimizerKind = Literal["adamw", "lamb", "sophiag", "muon", "mano"]
MATRIX_KINDS = ("muon", "mano")  # hidden matrices get the kind's update, the rest AdamW
# Newton-Schulz iterations: the quintic's singular values settle in about 5; more only add three
# matmuls per matrix per step each (and 10**9 of them would never let a step end).
MAX_NS_STEPS = 20


# The keys only some kinds read (config.py refuses one set for another kind). SophiaG keeps
# its own eps (1e-15, sophia.py): [optim] eps is not passed to it.
KIND_KEYS: dict[str, tuple[str, ...]] = {
    "lamb_max_weight_norm": ("lamb",),
    "sophia_rho": ("sophiag",),
    "sophia_hessian_interval": ("sophiag",),
    "momentum": MATRIX_KINDS,
    "nesterov": MATRIX_KINDS,
    "muon_ns_steps": ("muon",),
    "muon_lr_rule": ("muon",),
    "eps": ("adamw", "lamb", "muon", "mano"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimConfig:
    kind: OptimizerKind = "adamw"
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata=limits(below=1))
    eps: float = field(default=1e-8, metadata=limits(above=0))
    weight_decay: float = 0.1
    # lamb: the trust ratio's weight norm is clamped to this (You et al. leave the clamp open)
    lamb_max_weight_norm: float = field(default=10.0, metadata=limits(above=0))
    # sophiag: the clip's rho, and the steps between Hessian estimates (labels sampled from
    # the model, one extra forward and backward)
    sophia_rho: float = field(default=0.04, metadata=limits(above=0))
    sophia_hessian_interval: int = field(default=10, metadata=limits(at_least=1))
    # muon and mano: heavy-ball momentum on the hidden matrices
    momentum: float = field(default=0.95, metadata=limits(at_least=0, below=1))
    nesterov: bool = False
    # muon: Newton-Schulz iterations, and how the orthogonal update is scaled per shape:
    # "match_rms_adamw" (0.2 sqrt(max(out, in)): AdamW's learning rate and decay carry over) or
    # "spectral" (sqrt(max(1, out/in)): lr in spectral-norm units, ~0.02)
    muon_ns_steps: int = field(
        default=5,
        metadata=limits(
            at_least=1,
            at_most=MAX_NS_STEPS,
            why="5 converge; each more is three matmuls per matrix in every step",
        ),
    )
    muon_lr_rule: Literal["match_rms_adamw", "spectral"] = "match_rms_adamw"
    # QK-clip: after each step, heads whose largest attention logit passed this are scaled
    # back to it (Kimi K2's fix for Muon's logit growth; 100 there); None: off
    qk_clip: float | None = field(default=None, metadata=limits(above=0))
    # The schedule's lr is tuned for lr_reference_tokens per step (None: the global batch the
    # run started with, kept in its checkpoints); when the global batch differs, the lr is
    # scaled by the ratio ("linear") or its square root ("sqrt", for Adam-like optimizers).
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    lr_reference_tokens: int | None = field(default=None, metadata=limits(at_least=1))

    def __post_init__(self) -> None:
        if self.lr_reference_tokens is not None and self.lr_scaling == "none":
            raise GoodputError.usage(
                "[optim]",
                "lr_reference_tokens is set but lr_scaling is none",
                'set lr_scaling = "sqrt" or "linear", or drop lr_reference_tokens',
            )

    def inert_keys(self) -> dict[str, str]:
        """The keys of other kinds than ``kind``, and the kind each needs (config.py refuses
        them when set)."""
        return {
            key: " or ".join(f"kind = '{kind}'" for kind in kinds)
            for key, kinds in KIND_KEYS.items()
            if self.kind not in kinds
        }

    def lr_multiplier(self, tokens_per_step: int, reference_tokens: int) -> float:
        """The factor on the schedule's lr at ``tokens_per_step`` for an lr tuned at
        ``reference_tokens`` (``lr_reference_tokens`` wins over the run's own reference)."""
        reference = self.lr_reference_tokens or reference_tokens
        ratio = tokens_per_step / reference
        return {"none": 1.0, "linear": ratio, "sqrt": ratio**0.5}[self.lr_scaling]
