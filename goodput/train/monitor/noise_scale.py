"""The gradient noise scale B_simple = tr(Σ)/|G|², in tokens, from two batch sizes per step.

McCandlish et al. 2018 (arXiv 1812.06162), App. A.1: E[|G_B|²] = |G|² + tr(Σ)/B for a gradient
averaged over B tokens, so the squared norms measured at two batch sizes B_small < B_big give
unbiased estimates of both terms::

    |G|²_est  = (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr(Σ)_est = (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

One step's estimates are very noisy (either can be negative); only the ratio of their running
means means something. Numerator and denominator are therefore averaged SEPARATELY
(exponential moving averages with Adam-style bias correction), then divided: the mean of the
per-step ratios would be dominated by steps whose |G|²_est is near zero.

The measurement (the caller's): under data parallelism B_small is one rank's tokens per optimizer
step and |G_small|² the mean over the ranks of each rank's local squared gradient norm (the
gradient of its local mean loss, before the all-reduce; averaging keeps it unbiased and lowers
its variance); B_big is the global batch and |G_big|² the squared norm of the all-reduced
gradient. Both in fp32, before clipping.

Invariants: the state is three plain numbers (two EMA accumulators and the step count), so it
travels in a checkpoint's JSON train state; ``load_state_dict`` refuses, with a ``ValueError``
naming the key, anything that is not such a state. Non-finite measurements are ignored (the
state does not move). Does not measure gradients, reduce across ranks or log anything.
"""

from __future__ import annotations

import math
from typing import Any

MAX_STEPS = 2**62  # far beyond any run; bounds a hostile step count


class NoiseScale:
    """Running B_simple from one (|G_small|², |G_big|²) measurement per step."""

    def __init__(self, ema: float = 0.99) -> None:
        if not (isinstance(ema, int | float) and 0.0 <= ema < 1.0):
            raise ValueError(f"noise scale: ema {ema!r} must be in [0, 1)")
        self.ema = float(ema)
        self.steps = 0  # measurements averaged so far
        self._gradient_sq = 0.0  # EMA accumulators, not yet bias-corrected
        self._trace = 0.0

    def update(
        self, small_sq_norm: float, small_tokens: int, big_sq_norm: float, big_tokens: int
    ) -> float | None:
        """Average in one step's measurement; return B_simple in tokens (None while the
        averaged |G|² is not positive). Non-finite norms leave the state as it was."""
        for name, tokens in (("small_tokens", small_tokens), ("big_tokens", big_tokens)):
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
                raise ValueError(f"noise scale: {name} {tokens!r} must be a positive integer")
        if small_tokens == big_tokens:
            raise ValueError(
                f"noise scale: small_tokens = big_tokens = {big_tokens}: the estimate needs two "
                "batch sizes (more than one data-parallel rank)"
            )
        small, big = float(small_sq_norm), float(big_sq_norm)
        if not (math.isfinite(small) and math.isfinite(big)):
            return self.value()
        if small < 0 or big < 0:
            raise ValueError(
                f"noise scale: squared norms must not be negative (got {small!r}, {big!r})"
            )
        gradient_sq = (big_tokens * big - small_tokens * small) / (big_tokens - small_tokens)
        trace = (small - big) / (1.0 / small_tokens - 1.0 / big_tokens)
        if not (math.isfinite(gradient_sq) and math.isfinite(trace)):
            return self.value()  # overflow of huge inputs: ignored like a non-finite norm
        self._gradient_sq = self.ema * self._gradient_sq + (1.0 - self.ema) * gradient_sq
        self._trace = self.ema * self._trace + (1.0 - self.ema) * trace
        self.steps += 1
        return self.value()

    @property
    def gradient_sq(self) -> float | None:
        """The bias-corrected EMA of |G|²_est (None before the first measurement)."""
        return self._gradient_sq / self._correction() if self.steps else None

    @property
    def trace(self) -> float | None:
        """The bias-corrected EMA of tr(Σ)_est, per token (None before the first measurement)."""
        return self._trace / self._correction() if self.steps else None

    def value(self) -> float | None:
        """B_simple = EMA(tr(Σ)) / EMA(|G|²) in tokens; None until EMA(|G|²) is positive."""
        gradient_sq, trace = self.gradient_sq, self.trace
        if gradient_sq is None or trace is None or gradient_sq <= 0:
            return None
        ratio = trace / gradient_sq
        return ratio if math.isfinite(ratio) else None

    def _correction(self) -> float:
        # 1 − β^n, the weight the zero-initialised EMA has gathered; never 0 for n ≥ 1.
        return -math.expm1(self.steps * math.log(self.ema)) if self.ema > 0 else 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "gradient_sq": self._gradient_sq, "trace": self._trace}

    def load_state_dict(self, state: Any) -> None:
        """Take ``state_dict()``'s output back; anything else raises ``ValueError`` naming the
        key, and leaves this object as it was."""
        if not isinstance(state, dict):
            raise ValueError(f"noise scale state: expected a dict, got {type(state).__name__}")
        expected = {"steps", "gradient_sq", "trace"}
        unknown, missing = sorted(map(repr, set(state) - expected)), sorted(expected - set(state))
        if unknown:
            raise ValueError(f"noise scale state: unknown key {unknown[0]}")
        if missing:
            raise ValueError(f"noise scale state: missing key {missing[0]!r}")
        steps = state["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_STEPS:
            raise ValueError(
                f"noise scale state: 'steps' must be an integer in [0, {MAX_STEPS}], got {steps!r}"
            )
        gradient_sq, trace = _finite(state, "gradient_sq"), _finite(state, "trace")
        self.steps, self._gradient_sq, self._trace = steps, gradient_sq, trace


def _finite(state: dict[str, Any], key: str) -> float:
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"noise scale state: {key!r} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"noise scale state: {key!r} is out of range") from None
    if not math.isfinite(number):
        raise ValueError(f"noise scale state: {key!r} must be finite, got {value!r}")
    return number
