"""The LR range test's curve arithmetic on synthetic curves with known answers: the ramp, the
debiased EMA and its divergence stop, the plateau/basin/cliff regions (plateau-basin-cliff, no
cliff reached, all cliff, all plateau, a non-finite stop, a noisy curve) and the suggestion
rule (the minimum's lr / 10, never below the basin's start)."""

from __future__ import annotations

import math
import random

import pytest

from goodput.diagnose.lr_regions import (
    DIVERGENCE_FACTOR,
    SmoothedLoss,
    find_regions,
    noise_sigma,
    ramp,
    suggest,
)

LRS = ramp(1e-7, 10.0, 201)  # 25 points a decade: log10(lr) = -7 + i / 25
GRID = 10 ** (1 / 25)  # one grid step, as a factor of lr


def at(log10_lr: float) -> float:
    return 10.0**log10_lr


def shape(lr: float, *, fall_at: float = -5, turn_at: float = -2) -> float:
    """8 nats up to 1e-5, a straight fall to 3 nats at 1e-2, then a steep quadratic rise."""
    x = math.log10(lr)
    if x <= fall_at:
        return 8.0
    if x <= turn_at:
        return 8.0 - 5.0 * (x - fall_at) / (turn_at - fall_at)
    return 3.0 + 20.0 * (x - turn_at) ** 2


def close(a: float, b: float, factor: float = GRID * 1.001) -> bool:
    return b / factor <= a <= b * factor


def test_the_ramp_is_geometric_and_runs_both_ends():
    lrs = ramp(1e-5, 10.0, 40)
    assert lrs[0] == 1e-5 and lrs[-1] == 10.0 and len(lrs) == 40
    ratios = [b / a for a, b in zip(lrs, lrs[1:], strict=False)]
    assert max(ratios) == pytest.approx(min(ratios)) == pytest.approx(1e6 ** (1 / 39))


def test_the_smoothed_loss_is_debiased_and_stops_at_four_times_its_best():
    average = SmoothedLoss()
    assert average.add(5.0) == 5.0  # debiased: the first value is the loss itself
    assert average.add(5.0) == pytest.approx(5.0)
    # s2 = 0.98 * 0.1 + 0.02 * 1 after s1 = 0.02 * 5: by hand
    average = SmoothedLoss()
    average.add(5.0)
    expected = (0.98 * 0.02 * 5.0 + 0.02 * 1.0) / (1 - 0.98**2)
    assert average.add(1.0) == pytest.approx(expected)
    assert average.best == pytest.approx(expected)
    assert not average.diverged(DIVERGENCE_FACTOR * average.best)
    assert average.diverged(DIVERGENCE_FACTOR * average.best * 1.01)


def test_plateau_basin_cliff():
    smoothed = [shape(lr) for lr in LRS]
    stop = next(i for i, lr in enumerate(LRS) if lr > at(-1))  # the run stopped here
    regions = find_regions(LRS[: stop + 1], smoothed[: stop + 1], stopped_early=True)
    # tolerance: 5% of the 5-nat fall, 0.25 nats: crossed 4 points (0.2 nats each 3) past 1e-5
    assert regions.plateau is not None and regions.basin is not None and regions.cliff is not None
    assert regions.plateau[0] == LRS[0]
    assert close(regions.plateau[1], at(-5 + 3 / 25))
    assert close(regions.basin[0], at(-5 + 4 / 25))
    assert close(regions.basin[1], at(-2))  # the minimum
    assert close(regions.cliff[0], at(-2 + 1 / 25))
    assert regions.cliff[1] == LRS[stop]
    assert regions.suggested_lr == pytest.approx(regions.basin[1] / 10)
    assert close(regions.suggested_lr, at(-3))
    assert regions.note is None


def test_no_cliff_reached_the_basin_runs_to_the_end():
    lrs = ramp(1e-7, at(-3), 101)
    regions = find_regions(lrs, [shape(lr) for lr in lrs], stopped_early=False)
    assert regions.cliff is None
    assert regions.basin is not None and regions.basin[1] == lrs[-1]
    assert regions.plateau is not None and close(regions.plateau[1], at(-5 + 3 / 25))
    assert regions.suggested_lr == pytest.approx(lrs[-1] / 10)  # the minimum is the last point


def test_all_cliff_suggests_the_bottom_of_the_range():
    lrs = ramp(1e-2, 10.0, 40)
    smoothed = [3.0 + 20.0 * (math.log10(lr) + 2.0) ** 2 for lr in lrs]
    regions = find_regions(lrs, smoothed, stopped_early=True)
    assert regions.basin is None
    assert regions.cliff is not None and regions.cliff[1] == lrs[-1]
    assert regions.plateau is None or regions.plateau[1] < regions.cliff[0]
    assert regions.suggested_lr == lrs[0]
    assert regions.note is not None and "--min-lr" in regions.note


def test_all_plateau_suggests_the_top_of_the_range():
    lrs = ramp(1e-7, 1e-5, 30)
    regions = find_regions(lrs, [8.0] * 30, stopped_early=False)
    assert regions.plateau == (lrs[0], lrs[-1])
    assert regions.basin is None and regions.cliff is None
    assert regions.suggested_lr == lrs[-1]
    assert regions.note is not None and "--max-lr" in regions.note


def test_a_non_finite_point_ends_the_curve_in_the_cliff():
    lrs = ramp(1e-7, 1e-2, 126)  # ends at the minimum of the shape
    smoothed: list[float | None] = [shape(lr) for lr in lrs]
    smoothed[-1] = None  # that step's loss was not finite
    regions = find_regions(lrs, smoothed, stopped_early=True)
    assert regions.cliff == (lrs[-1], lrs[-1])
    assert regions.basin is not None and regions.basin[1] == lrs[-2]
    nan_curve = [*smoothed[:-1], math.nan]
    assert find_regions(lrs, nan_curve, stopped_early=True) == regions


def test_a_first_step_that_failed_is_all_cliff():
    regions = find_regions([1e-3, 1e-2], [None, None], stopped_early=True)
    assert regions.plateau is None and regions.basin is None
    assert regions.cliff == (1e-3, 1e-2) and regions.suggested_lr == 1e-3


@pytest.mark.parametrize("seed", range(20))
def test_a_noisy_curve_keeps_its_regions_in_order(seed):
    """The shape plus Gaussian noise of 0.3 nats a step, smoothed as the ramp smooths it."""
    rng = random.Random(seed)
    average = SmoothedLoss()
    smoothed, lrs = [], []
    for lr in LRS:
        value = average.add(shape(lr) + rng.gauss(0, 0.3))
        smoothed.append(value)
        lrs.append(lr)
        if average.diverged(value):
            break
    regions = find_regions(lrs, smoothed, stopped_early=len(lrs) < len(LRS))
    assert regions.plateau is not None and regions.basin is not None and regions.cliff is not None
    assert regions.plateau[1] < regions.basin[0] <= regions.basin[1] < regions.cliff[0]
    # The plateau ends near 1e-5, where the loss starts to fall: the noise did not end it
    # decades early, and the EMA's lag (about 50 steps, 2 decades) did not push it far past.
    assert at(-6.5) <= regions.plateau[1] <= at(-3.5)
    # The suggestion lies in the basin, below where the true loss turns up (1e-2).
    assert regions.basin[0] <= regions.suggested_lr < at(-2)
    assert noise_sigma(smoothed[:50]) < 0.3  # smoothing took most of the noise out


def test_the_suggestion_never_goes_below_the_basin():
    assert suggest(1e-2, (1e-5, 1e-2)) == pytest.approx(1e-3)
    assert suggest(1e-3, (5e-4, 1e-3)) == 5e-4  # a basin shorter than a decade
