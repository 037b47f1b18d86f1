"""The two-batch gradient noise scale recovers tr(Σ)/|G|² from synthetic per-token gradients of
known covariance; its state survives JSON and refuses what is not its state."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from goodput.testing.fuzz import json_values
from goodput.train.monitor.noise_scale import NoiseScale


def synthetic_measurements(seed, steps, num_ranks, tokens_per_rank, dim=16, b_simple=20.0):
    """(expected B_simple, per step (|G_small|², |G_big|²)): per-token gradients
    g = G + A·z, z ~ N(0, I), so Σ = A·Aᵀ and tr(Σ) = ‖A‖²_F; each rank's gradient is the mean
    of its tokens', the big batch's the mean of all of them."""
    generator = torch.Generator().manual_seed(seed)
    true_gradient = torch.randn(dim, generator=generator, dtype=torch.float64)
    mixing = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    mixing *= (b_simple * true_gradient.square().sum() / mixing.square().sum()).sqrt()
    expected = float(mixing.square().sum() / true_gradient.square().sum())
    measurements = []
    for start in range(0, steps, 1000):
        count = min(1000, steps - start)
        noise = torch.randn(count, num_ranks, tokens_per_rank, dim, generator=generator).double()
        per_token = true_gradient + noise @ mixing.T
        per_rank = per_token.mean(2)
        small = per_rank.square().sum(-1).mean(-1)  # mean over ranks of the local |g|²
        big = per_rank.mean(1).square().sum(-1)  # the all-reduced gradient
        measurements += zip(small.tolist(), big.tolist(), strict=True)
    return expected, measurements


def test_converges_to_the_known_noise_scale():
    expected, measurements = synthetic_measurements(0, 10_000, num_ranks=4, tokens_per_rank=8)
    assert expected == pytest.approx(20.0)
    noise_scale = NoiseScale(ema=0.999)
    for small, big in measurements:
        value = noise_scale.update(small, 8, big, 32)
    assert value == pytest.approx(expected, rel=0.05)
    assert noise_scale.trace / noise_scale.gradient_sq == value


def test_numerator_and_denominator_are_averaged_apart_with_bias_correction():
    noise_scale = NoiseScale(ema=0.5)
    # (B_small, B_big) = (1, 3): |G|² = (3·big − small)/2, tr(Σ) = (small − big)·3/2
    first = noise_scale.update(4.0, 1, 2.0, 3)  # |G|² 1, tr 3
    assert first == pytest.approx(3.0)
    assert noise_scale.gradient_sq == pytest.approx(1.0)  # bias-corrected: not 0.5
    second = noise_scale.update(10.0, 1, 2.0, 3)  # |G|² −2, tr 12
    # EMAs 0.5·(0.5·1) + 0.5·(−2) = −0.75 and 0.5·(0.5·3) + 0.5·12 = 6.75, each over 0.75
    assert noise_scale.gradient_sq == pytest.approx(-1.0)
    assert second is None  # the averaged |G|² is negative: no estimate yet
    third = noise_scale.update(1.0, 1, 1.0, 3)  # no noise: |G|² 1, tr 0
    # EMAs 0.5·(−0.75) + 0.5·1 = 0.125 and 0.5·6.75 = 3.375: their ratio, not a mean of the
    # per-step ratios (3, −6, 0)
    assert third == pytest.approx(3.375 / 0.125)
    assert noise_scale.gradient_sq == pytest.approx(0.125 / 0.875)


def test_none_until_the_averaged_gradient_is_positive():
    noise_scale = NoiseScale()
    assert noise_scale.value() is None
    assert noise_scale.update(10.0, 1, 1.0, 2) is None  # |G|²_est = (2 − 10)/1 < 0


def test_non_finite_measurements_leave_the_state_unchanged():
    noise_scale = NoiseScale()
    noise_scale.update(3.0, 8, 2.0, 32)
    before = noise_scale.state_dict()
    for small, big in [(math.nan, 1.0), (1.0, math.inf), (-math.inf, 1.0), (1e308, 0.0)]:
        assert noise_scale.update(small, 8, big, 32) == noise_scale.value()
        assert noise_scale.state_dict() == before


def test_refuses_one_batch_size_and_bad_inputs():
    noise_scale = NoiseScale()
    with pytest.raises(ValueError, match="two batch sizes"):
        noise_scale.update(1.0, 8, 1.0, 8)
    with pytest.raises(ValueError, match="small_tokens"):
        noise_scale.update(1.0, 0, 1.0, 8)
    with pytest.raises(ValueError, match="negative"):
        noise_scale.update(-1.0, 4, 1.0, 8)
    for ema in (1.0, -0.1, math.nan):
        with pytest.raises(ValueError, match="ema"):
            NoiseScale(ema)


def test_state_round_trip_through_json_gives_the_same_later_values():
    _, measurements = synthetic_measurements(1, 200, num_ranks=2, tokens_per_rank=4)
    straight, resumed = NoiseScale(), NoiseScale()
    for small, big in measurements[:100]:
        straight.update(small, 4, big, 8)
    resumed.load_state_dict(json.loads(json.dumps(straight.state_dict())))
    for small, big in measurements[100:]:
        assert resumed.update(small, 4, big, 8) == straight.update(small, 4, big, 8)


@pytest.mark.parametrize(
    ("state", "key"),
    [
        ({"steps": 1, "gradient_sq": 1.0}, "trace"),
        ({"steps": 1, "gradient_sq": 1.0, "trace": 1.0, "extra": 0}, "extra"),
        ({"steps": -1, "gradient_sq": 1.0, "trace": 1.0}, "steps"),
        ({"steps": True, "gradient_sq": 1.0, "trace": 1.0}, "steps"),
        ({"steps": 1, "gradient_sq": "1", "trace": 1.0}, "gradient_sq"),
        ({"steps": 1, "gradient_sq": 1.0, "trace": math.nan}, "trace"),
        ({"steps": 1, "gradient_sq": 10**400, "trace": 1.0}, "gradient_sq"),
    ],
)
def test_a_broken_state_names_its_key(state, key):
    noise_scale = NoiseScale()
    with pytest.raises(ValueError, match=key):
        noise_scale.load_state_dict(state)
    assert noise_scale.state_dict() == NoiseScale().state_dict()


NUMBERS = st.integers() | st.floats() | st.booleans() | st.none() | st.text(max_size=5)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    json_values()
    | st.fixed_dictionaries({"steps": NUMBERS, "gradient_sq": NUMBERS, "trace": NUMBERS})
    | st.dictionaries(st.sampled_from(["steps", "gradient_sq", "trace", "x"]), NUMBERS)
)
def test_any_state_loads_or_raises_value_error(state):
    noise_scale = NoiseScale()
    try:
        noise_scale.load_state_dict(state)
    except ValueError:
        assert noise_scale.state_dict() == NoiseScale().state_dict()
        return
    assert noise_scale.state_dict() == state
    json.dumps(noise_scale.state_dict(), allow_nan=False)  # what a checkpoint can hold
    value = noise_scale.update(2.0, 4, 1.0, 8)
    assert value is None or math.isfinite(value)
