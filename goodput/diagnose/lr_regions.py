"""The LR range test's curve arithmetic: the ramp, the smoothed loss, the stop rule, and the
three regions of the (lr, smoothed loss) curve with the suggested LR. Pure functions of plain
numbers (no torch), so every rule is tested on synthetic curves with known answers.

The curve (optim.md section 9): ŝ is fastai's debiased EMA of the loss (β = 0.98,
ŝ = s / (1 − β^n)); the ramp stops at the cliff, when ŝ exceeds ``DIVERGENCE_FACTOR`` times its
best value or a step's loss or gradient norm is not finite. Regions, each an lr interval or
absent:

- plateau: lr too small; ŝ stays within ``tolerance`` of its start (the median of its first
  tenth).
- basin: ŝ falls: from the point after which it stays below start − tolerance, to its minimum.
- cliff: past the minimum, when ŝ rises above minimum + tolerance there or the run stopped
  there (divergence, a non-finite step). A curve that never fell is a cliff from the point
  after which it stays above start + tolerance.

The suggestion is ``suggest``'s rule: the lr of the minimum / 10, never below the basin's start.

This module does not run anything, print or write files.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BETA = 0.98  # fastai's smoothing
DIVERGENCE_FACTOR = 4.0  # fastai's stop_div: ŝ > 4 x best ŝ
# The tolerance of "within noise": the largest of these. A fraction of the whole fall (a curve
# that fell 4 nats has left its plateau once it fell 0.2), three sigmas of ŝ's point-to-point
# noise and of its start's spread, and a floor relative to the start so that a noise-free flat
# curve is still flat.
FALL_FRACTION = 0.05
NOISE_SIGMAS = 3.0
RELATIVE_FLOOR = 1e-3
SUGGESTION_DIVISOR = 10.0
START_FRACTION = 0.1  # the points whose median is the curve's start

Interval = tuple[float, float]


def ramp(min_lr: float, max_lr: float, num_steps: int) -> list[float]:
    """lr_i = min · (max/min)^(i/(N−1)), i = 0..N−1: both ends are run."""
    assert 0 < min_lr < max_lr and num_steps >= 2
    ratio = max_lr / min_lr
    lrs = [min_lr * ratio ** (i / (num_steps - 1)) for i in range(num_steps)]
    lrs[-1] = max_lr  # exactly, not a rounding away from it
    return lrs


class SmoothedLoss:
    """The debiased EMA of the loss, and whether it diverged (past ``DIVERGENCE_FACTOR`` x its
    best)."""

    def __init__(self, beta: float = BETA) -> None:
        self.beta = beta
        self.average = 0.0
        self.count = 0
        self.best = math.inf

    def add(self, loss: float) -> float:
        """Take one finite loss; the new ŝ (infinite when a loss near float's limit overflows
        it: the caller's cliff)."""
        assert math.isfinite(loss)
        self.count += 1
        self.average = self.beta * self.average + (1 - self.beta) * loss
        smoothed = self.average / (1 - self.beta**self.count)
        self.best = min(self.best, smoothed)
        return smoothed

    def diverged(self, smoothed: float) -> bool:
        return smoothed > DIVERGENCE_FACTOR * self.best


@dataclass(frozen=True, slots=True)
class Regions:
    plateau: Interval | None
    basin: Interval | None
    cliff: Interval | None
    suggested_lr: float
    note: str | None  # why the suggestion is only a bound (no basin), else None

    def as_json(self) -> dict[str, list[float] | None]:
        return {
            name: None if interval is None else list(interval)
            for name, interval in (
                ("plateau", self.plateau),
                ("basin", self.basin),
                ("cliff", self.cliff),
            )
        }


def noise_sigma(smoothed: Sequence[float]) -> float:
    """The point-to-point noise of a curve, robustly: a smooth trend has second differences
    near 0, white noise of sigma s has them of sigma s·√6; the median absolute deviation keeps
    the cliff's steep end from counting as noise."""
    if len(smoothed) < 3:
        return 0.0
    second = [
        smoothed[i + 1] - 2 * smoothed[i] + smoothed[i - 1] for i in range(1, len(smoothed) - 1)
    ]
    mad = statistics.median(abs(d) for d in second)
    return mad / 0.6745 / math.sqrt(6)


def start_level(smoothed: Sequence[float]) -> float:
    """Where the curve starts: the median of its first tenth (at least one point). The first
    points of a debiased EMA are its noisiest (the first is one raw loss), so a lucky or
    unlucky first batch must not move the reference (fastai, too, skips the first tenth)."""
    return statistics.median(_first_tenth(smoothed))


def start_sigma(smoothed: Sequence[float]) -> float:
    """The spread of the first tenth around its median (a robust sigma): how uncertain the
    start is, which a move from it must exceed."""
    start = start_level(smoothed)
    return 1.4826 * statistics.median(abs(value - start) for value in _first_tenth(smoothed))


def _first_tenth(smoothed: Sequence[float]) -> Sequence[float]:
    return smoothed[: max(1, math.ceil(len(smoothed) * START_FRACTION))]


def tolerance(smoothed: Sequence[float]) -> float:
    """How far ŝ must move from a reference to count as a move, not noise."""
    start, lowest = start_level(smoothed), min(smoothed)
    return max(
        FALL_FRACTION * (start - lowest),
        NOISE_SIGMAS * noise_sigma(smoothed),
        NOISE_SIGMAS * start_sigma(smoothed),
        RELATIVE_FLOOR * abs(start),
    )


def find_regions(
    lrs: Sequence[float], smoothed: Sequence[float | None], stopped_early: bool
) -> Regions:
    """The regions of the curve and the suggested LR. ``smoothed[i]`` is ŝ at ``lrs[i]``, None
    (or NaN) from a step whose loss was not finite; the curve is read up to its first such
    point, which, like an early stop, belongs to the cliff."""
    assert len(lrs) == len(smoothed) and lrs
    finite = _finite_prefix(smoothed)
    last = len(lrs) - 1  # the last lr run: the stop, when it stopped early
    if not finite:  # the first step already failed
        return Regions(None, None, (lrs[0], lrs[last]), lrs[0], _NOTE_ALL_CLIFF)
    tol = tolerance(finite)
    start = start_level(finite)
    lowest_at = min(range(len(finite)), key=finite.__getitem__)
    ends_in_cliff = stopped_early or len(finite) < len(smoothed)
    if finite[lowest_at] >= start - tol:  # it never fell
        # It rises from the point after which it stays above start + tolerance.
        rise_at = _after_last(finite, lambda value: value <= start + tol)
        if rise_at == len(finite) and ends_in_cliff:  # it ends within the tolerance, then stops
            rise_at = last if len(finite) == len(smoothed) else len(finite)
        elif rise_at == len(finite):  # it ends within the tolerance: no rise
            return Regions((lrs[0], lrs[last]), None, None, lrs[last], _NOTE_ALL_PLATEAU)
        plateau = (lrs[0], lrs[rise_at - 1]) if rise_at >= 2 else None
        return Regions(plateau, None, (lrs[rise_at], lrs[last]), lrs[0], _NOTE_ALL_CLIFF)
    # The fall starts after the last point up to the minimum still within the tolerance of
    # the start: early noise below it (a debiased EMA's first points are its noisiest) is
    # not the fall.
    fall_at = _after_last(finite[:lowest_at], lambda value: value >= start - tol)
    plateau = (lrs[0], lrs[fall_at - 1]) if fall_at >= 2 else None
    basin_start = fall_at if plateau else 0
    rises = any(value > finite[lowest_at] + tol for value in finite[lowest_at:])
    if (rises or ends_in_cliff) and lowest_at < last:
        basin = (lrs[basin_start], lrs[lowest_at])
        cliff: Interval | None = (lrs[lowest_at + 1], lrs[last])
    else:  # no cliff reached: the basin runs to the end of the ramp
        basin, cliff = (lrs[basin_start], lrs[last]), None
    return Regions(plateau, basin, cliff, suggest(lrs[lowest_at], basin), None)


def suggest(lowest_lr: float, basin: Interval) -> float:
    """The suggested LR: "just below where the loss turns up".

    fastai's ``minimum`` rule (optim.md section 9): the lr at the minimum of ŝ divided by 10.
    At the minimum the loss is already turning, and ŝ lags the raw loss by about 1/(1 − β) = 50
    steps (with 200 steps over 8 decades, about 2 decades of lr), so the minimum of ŝ sits past
    the turn of the raw loss; a decade below it is inside the falling part, where ``steep`` and
    ``valley`` also lie. But never below the basin's start: below it the lr is on the plateau,
    too small to make progress, which a short basin (under a decade) would otherwise suggest.
    """
    return max(lowest_lr / SUGGESTION_DIVISOR, basin[0])


_NOTE_ALL_PLATEAU = "the loss did not fall over the ramp: raise --max-lr (or run more --steps)"
_NOTE_ALL_CLIFF = "the loss never fell before it rose: lower --min-lr"


def _finite_prefix(values: Sequence[float | None]) -> list[float]:
    prefix = []
    for value in values:
        if value is None or not math.isfinite(value):
            break
        prefix.append(value)
    return prefix


def _after_last(values: Sequence[float], condition: Callable[[float], bool]) -> int:
    """The index after the last value that meets ``condition``; 0 if none does."""
    return next((i + 1 for i in range(len(values) - 1, -1, -1) if condition(values[i])), 0)
