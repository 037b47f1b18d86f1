"""Robust loss-spike z-scores: one spike in flat noise is flagged at its step and no other; a
falling loss is not; a window without spread still scores; a resumed state scores alike."""

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from goodput.testing.fuzz import json_values
from goodput.train.monitor.loss_spikes import LossSpikes


def noisy(num_steps, level=3.0, noise=0.02, seed=0):
    rng = random.Random(seed)
    return [level + rng.gauss(0, noise) for _ in range(num_steps)]


def flagged(spikes, losses):
    warnings = {}
    for step, loss in enumerate(losses, start=1):
        _, warning = spikes.update(step, loss)
        if warning:
            warnings[step] = warning
    return warnings


def test_one_spike_in_flat_noise_is_flagged_at_its_step_only():
    losses = noisy(300)
    losses[149] += 0.5  # step 150: 25 noise standard deviations
    warnings = flagged(LossSpikes(), losses)
    assert list(warnings) == [150]
    line = warnings[150]
    assert line.startswith("warning: loss spike: step 150 loss ")
    assert f"loss {losses[149]:.4f}" in line and "median 3.0" in line and "z = " in line
    assert "\n" not in line


def test_z_is_the_robust_score_and_none_before_min_history():
    spikes = LossSpikes(window=5, min_history=3)
    assert spikes.update(1, 1.0) == (None, None)
    assert spikes.update(2, 2.0) == (None, None)
    z, _ = spikes.update(3, 3.0)  # 2 losses before it: still fewer than 3
    assert z is None
    z, warning = spikes.update(4, 4.0)  # history [1, 2, 3]: median 2, MAD 1
    assert z == pytest.approx((4.0 - 2.0) / 1.4826) and warning is None


def test_a_steadily_falling_loss_is_not_flagged():
    losses = [10.0 * math.exp(-step / 300) + 2.0 + n for step, n in enumerate(noisy(2000, 0.0))]
    spikes = LossSpikes()
    scores = [spikes.update(step, loss)[0] for step, loss in enumerate(losses, start=1)]
    assert not flagged(LossSpikes(), losses)
    assert max(z for z in scores if z is not None) < 6.0


def test_mad_zero_falls_back_to_the_mean_deviation_then_to_the_loss_resolution():
    spikes = LossSpikes(window=20, min_history=20)
    for step in range(1, 21):
        spikes.update(step, 2.5)  # one value: MAD and mean deviation both 0
    assert spikes.update(21, 2.5) == (0.0, None)
    z, warning = spikes.update(22, 2.6)
    assert math.isfinite(z) and z > 1e4 and warning.startswith("warning: loss spike: step 22")
    spikes = LossSpikes(window=20, min_history=20)
    for step in range(1, 21):  # MAD 0 (16 of 20 alike), mean deviation 4·0.1/20
        spikes.update(step, 2.6 if step % 5 == 0 else 2.5)
    z, _ = spikes.update(21, 2.6)
    assert z == pytest.approx(0.1 / (1.2533 * 0.02))


def test_non_finite_losses_are_not_scored_and_not_kept():
    spikes = LossSpikes(window=30, min_history=20)
    flagged(spikes, noisy(25))
    before = spikes.state_dict()
    for loss in (math.nan, math.inf, -math.inf):
        assert spikes.update(26, loss) == (None, None)
    assert spikes.state_dict() == before


def test_state_round_trip_gives_identical_later_z():
    losses = noisy(400, seed=3)
    losses[250] += 1.0
    straight, resumed = LossSpikes(), LossSpikes()
    for step, loss in enumerate(losses[:200], start=1):
        straight.update(step, loss)
    state = json.loads(json.dumps(straight.state_dict(), allow_nan=False))
    assert len(state["losses"]) == 100  # bounded by the window
    resumed.load_state_dict(state)
    for step, loss in enumerate(losses[200:], start=201):
        assert resumed.update(step, loss) == straight.update(step, loss)


def test_a_longer_saved_window_keeps_its_latest_losses():
    spikes = LossSpikes(window=3, min_history=1)
    spikes.load_state_dict({"losses": [1.0, 2.0, 3.0, 4.0]})
    assert spikes.state_dict() == {"losses": [2.0, 3.0, 4.0]}


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ([1.0], "expected a dict"),
        ({}, "missing key 'losses'"),
        ({"losses": [], "z": 1}, "unknown key 'z'"),
        ({"losses": "1.0"}, "'losses' must be a list"),
        ({"losses": [1.0, None]}, "'losses' holds a non-number"),
        ({"losses": [True]}, "'losses' holds a non-number"),
        ({"losses": [math.nan]}, "'losses' holds a non-finite"),
        ({"losses": [10**400]}, "'losses' holds an out-of-range"),
        ({"losses": [0.0] * (2**16 + 1)}, "at most 65536"),
    ],
)
def test_a_broken_state_is_refused_by_key(state, match):
    spikes = LossSpikes()
    with pytest.raises(ValueError, match=match):
        spikes.load_state_dict(state)
    assert spikes.state_dict() == {"losses": []}


@pytest.mark.parametrize(
    "kwargs", [{"window": 0}, {"min_history": 101}, {"threshold": 0}, {"threshold": math.inf}]
)
def test_refuses_bad_settings(kwargs):
    with pytest.raises(ValueError):
        LossSpikes(**kwargs)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(json_values() | st.fixed_dictionaries({"losses": st.lists(json_values(), max_size=8)}))
def test_any_state_loads_or_raises_value_error(state):
    spikes = LossSpikes(window=5, min_history=1)
    try:
        spikes.load_state_dict(state)
    except ValueError:
        return
    json.dumps(spikes.state_dict(), allow_nan=False)
    z, _ = spikes.update(1, 1.0)
    assert (z is None) == (not state["losses"])
