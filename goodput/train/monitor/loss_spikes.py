"""Loss spikes: each step's loss as a robust z-score against the losses just before it.

z = (loss − median) / (1.4826 · MAD) over the previous ``window`` finite losses, where MAD is
their median absolute deviation from the median (1.4826 · MAD estimates the standard deviation
of normal noise). Median and MAD ignore the spikes they are meant to find, so one spike neither
hides the next nor raises the bar for it, and a steadily falling loss stays near z ≈ 0 to
slightly negative (each new loss is below the recent median). When MAD is 0 (more than half of
the window holds one value) the scale falls back to 1.2533 · the mean absolute deviation
(Iglewicz & Hoaglin's modified z-score), and when every loss in the window is the same number,
to the fp32 spacing of the losses at the median: a difference the loss cannot even resolve is
z ≈ 1, a real jump off a flat history is a huge z, never inf.

Invariants: z is None until ``min_history`` finite losses were seen; non-finite losses give no
z, no warning and never enter the window (the non-finite guard in ``step.py`` owns them). The
state is the window itself, a JSON list of at most ``window`` floats. Does not decide anything:
the loop prints the warning line and logs z.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import deque
from typing import Any

from goodput.train.config.run import MAX_WINDOW, MIN_HISTORY

NORMAL_MAD_SCALE = 1.4826  # 1 / Φ⁻¹(3/4): MAD → standard deviation for normal noise
NORMAL_MEAN_AD_SCALE = 1.2533  # √(π/2): mean absolute deviation → standard deviation
FP32_SPACING = 2.0**-23  # relative spacing of fp32 values, the precision of the loss
FP32_TINY = 2.0**-126  # the smallest normal fp32: the spacing floor at a median of 0


class LossSpikes:
    """Robust z-scores of the loss, and a warning line for a spike."""

    def __init__(
        self, window: int = 100, threshold: float = 6.0, min_history: int = MIN_HISTORY
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
            raise ValueError(
                f"loss spikes: window {window!r} must be an integer in [1, {MAX_WINDOW}]"
            )
        if (
            isinstance(min_history, bool)
            or not isinstance(min_history, int)
            or not 1 <= min_history <= window
        ):
            raise ValueError(
                f"loss spikes: min_history {min_history!r} must be an integer in [1, window = "
                f"{window}]"
            )
        if not (isinstance(threshold, int | float) and math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"loss spikes: threshold {threshold!r} must be a positive number")
        self.window, self.threshold, self.min_history = window, float(threshold), min_history
        self._losses: deque[float] = deque(maxlen=window)

    def update(self, step: int, loss: float) -> tuple[float | None, str | None]:
        """Score ``loss`` (step ``step``) against the window, then add it to the window; return
        (z, the warning line when z > threshold)."""
        loss = float(loss)
        if not math.isfinite(loss):
            return None, None
        z, median = self._score(loss)
        self._losses.append(loss)
        if z is None or z <= self.threshold:
            return z, None
        return z, (
            f"warning: loss spike: step {step} loss {loss:.4f} is z = {z:.1f} robust standard "
            f"deviations above the median {median:.4f} of the previous {len(self._losses) - 1} "
            f"losses (threshold {self.threshold:g}); if spikes repeat, check the data of these "
            "steps, or lower the learning rate or resume from a checkpoint before them"
        )

    def _score(self, loss: float) -> tuple[float | None, float]:
        if len(self._losses) < self.min_history:
            return None, math.nan
        median = statistics.median(self._losses)
        deviations = [abs(value - median) for value in self._losses]
        scale = NORMAL_MAD_SCALE * statistics.median(deviations)
        if scale == 0:
            scale = NORMAL_MEAN_AD_SCALE * math.fsum(deviations) / len(deviations)
        if scale == 0:  # one value throughout: the loss's own resolution is the spread
            scale = max(abs(median) * FP32_SPACING, FP32_TINY)
        z = (loss - median) / scale
        return (z if math.isfinite(z) else math.copysign(sys.float_info.max, z)), median

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self._losses)}

    def load_state_dict(self, state: Any) -> None:
        """Take ``state_dict()``'s output back (a longer window than this one's keeps its most
        recent losses); anything else raises ``ValueError`` naming the key and changes nothing."""
        if not isinstance(state, dict):
            raise ValueError(f"loss spikes state: expected a dict, got {type(state).__name__}")
        unknown = sorted(map(repr, set(state) - {"losses"}))
        if unknown:
            raise ValueError(f"loss spikes state: unknown key {unknown[0]}")
        if "losses" not in state:
            raise ValueError("loss spikes state: missing key 'losses'")
        losses = state["losses"]
        if not isinstance(losses, list) or len(losses) > MAX_WINDOW:
            raise ValueError(
                f"loss spikes state: 'losses' must be a list of at most {MAX_WINDOW} numbers"
            )
        values = []
        for value in losses:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"loss spikes state: 'losses' holds a non-number {value!r}")
            try:
                number = float(value)
            except OverflowError:
                raise ValueError(
                    "loss spikes state: 'losses' holds an out-of-range number"
                ) from None
            if not math.isfinite(number):
                raise ValueError(f"loss spikes state: 'losses' holds a non-finite {value!r}")
            values.append(number)
        self._losses = deque(values[-self.window :], maxlen=self.window)
