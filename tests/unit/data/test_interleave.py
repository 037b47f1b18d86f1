"""The blend interleave: the per-prefix bound, exact EDF semantics, and the greedy baseline."""

from __future__ import annotations

import heapq
import importlib.machinery
import math

import numpy as np
import pytest

from goodput.data import interleave
from goodput.data.interleave import (
    build_blend_index,
    greedy_blend_index,
    max_batch_deviation,
    normalise_weights,
)
from goodput.errors import GoodputError

# Float slack on the bound; the schedule itself is integer, only w * n is rounded.
SLACK = 1e-9


def _dirichlet(num_corpora: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).dirichlet(np.ones(num_corpora))


# (weights, num_samples): every shape of mixture the bound must survive. Tiny weights push corpora
# into the far heap (window longer than the near bitmap) and a lap ahead on the release calendar.
WEIGHT_SETS = {
    "dirichlet-2": (_dirichlet(2, 0), 100_000),
    "dirichlet-3": (_dirichlet(3, 1), 100_000),
    "dirichlet-7": (_dirichlet(7, 2), 100_000),
    "dirichlet-100": (_dirichlet(100, 3), 200_000),
    "dirichlet-100-sparse": (np.random.default_rng(4).dirichlet(np.full(100, 0.1)), 200_000),
    "skewed": (np.array([0.999, 0.0005, 0.0005]), 100_000),
    "equal-2": (np.ones(2), 10_000),
    "equal-10": (np.ones(10), 50_000),
    "equal-1000": (np.ones(1000), 50_000),
    "equal-32767": (np.ones(interleave.MAX_CORPORA), 100_000),
    "single": (np.ones(1), 1_000),
    "many-tiny": (np.array([1.0] + [1e-4] * 500), 100_000),
    "tiny-beyond-calendar": (np.array([1.0, 1.0, 1.0] + [3e-5] * 5), 300_000),
    "powers-of-two": (2.0 ** -np.arange(1, 16), 100_000),
}


def _running_count(corpus_index: np.ndarray, num_corpora: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, rank): positions grouped by corpus, and each one's rank within its corpus."""
    order = np.argsort(corpus_index, kind="stable")
    grouped = corpus_index[order].astype(np.int64)
    first = np.searchsorted(grouped, np.arange(num_corpora))
    return order, np.arange(corpus_index.size) - first[grouped]


def _assert_prefix_bound(corpus_index: np.ndarray, weights: np.ndarray) -> None:
    """|count_d(n) - w_d n| <= 1 for every prefix n and corpus d, without trusting sample_index.

    count - w n peaks right after a sample of d (prefix pos + 1) and bottoms out right before one
    (prefix pos) or at the very end, so checking those points checks every prefix.
    """
    w = normalise_weights(weights)
    order, rank = _running_count(corpus_index, w.size)
    corpus = corpus_index[order]
    after = rank + 1 - w[corpus] * (order + 1)
    before = rank - w[corpus] * order
    at_end = np.bincount(corpus_index, minlength=w.size) - w * corpus_index.size
    assert after.max(initial=0.0) <= 1 + SLACK
    assert before.min(initial=0.0) >= -1 - SLACK
    assert np.abs(at_end).max() <= 1 + SLACK


def _reference_edf(weights: np.ndarray, num_samples: int) -> list[int]:
    """EDF with two heaps, as specified: release ceil(k/w), deadline floor((k+1)/w) + 1."""
    w = [float(x) for x in normalise_weights(weights)]
    count = [0] * len(w)
    ready = [(math.floor(1 / w[d]) + 1, d) for d in range(len(w))]
    heapq.heapify(ready)
    pending: list[tuple[int, int]] = []
    order = []
    for slot in range(1, num_samples + 1):
        while pending and pending[0][0] <= slot:
            _, d = heapq.heappop(pending)
            heapq.heappush(ready, (math.floor((count[d] + 1) / w[d]) + 1, d))
        _, d = heapq.heappop(ready)
        order.append(d)
        count[d] += 1
        release = math.ceil(count[d] / w[d])
        if release <= slot:
            heapq.heappush(ready, (math.floor((count[d] + 1) / w[d]) + 1, d))
        else:
            heapq.heappush(pending, (release, d))
    return order


def _reference_greedy(weights: np.ndarray, num_samples: int) -> list[int]:
    w = normalise_weights(weights)
    count = np.zeros(w.size)
    order = []
    for i in range(num_samples):
        d = int(np.argmax(w * max(i, 1) - count))  # argmax takes the first, i.e. lowest id
        order.append(d)
        count[d] += 1
    return order


@pytest.mark.parametrize("name", sorted(WEIGHT_SETS))
def test_every_prefix_is_within_one_sample_of_the_mixture(name):
    weights, num_samples = WEIGHT_SETS[name]
    corpus_index, sample_index = interleave._outputs(num_samples)
    fallbacks = interleave._run(
        "goodput_edf_interleave", normalise_weights(weights), corpus_index, sample_index
    )
    _assert_prefix_bound(corpus_index, weights)
    assert fallbacks == 0  # every slot had a released item: the fallback is never needed


def test_prefix_check_agrees_with_brute_force():
    weights = _dirichlet(7, 5)
    corpus_index, _ = build_blend_index(weights, 3000)
    counts = np.cumsum(np.eye(7, dtype=np.int64)[corpus_index], axis=0)
    prefixes = np.arange(1, 3001)[:, None]
    assert np.abs(counts - normalise_weights(weights) * prefixes).max() <= 1 + SLACK
    _assert_prefix_bound(corpus_index, weights)


@pytest.mark.parametrize(
    "weights",
    [_dirichlet(5, 6), _dirichlet(40, 7), np.ones(6), np.array([0.5, 0.25, 0.125, 0.125])],
    ids=["dirichlet-5", "dirichlet-40", "equal-6", "dyadic"],
)
def test_matches_the_specified_edf_including_ties(weights):
    corpus_index, _ = build_blend_index(weights, 3000)
    assert corpus_index.tolist() == _reference_edf(weights, 3000)


def test_is_deterministic_and_prefix_stable():
    weights = _dirichlet(100, 8)
    short_corpus, short_sample = build_blend_index(weights, 20_000)
    long_corpus, long_sample = build_blend_index(weights, 150_000)
    again_corpus, again_sample = build_blend_index(weights, 150_000)
    np.testing.assert_array_equal(long_corpus, again_corpus)
    np.testing.assert_array_equal(long_sample, again_sample)
    np.testing.assert_array_equal(long_corpus[:20_000], short_corpus)
    np.testing.assert_array_equal(long_sample[:20_000], short_sample)


def test_weights_are_normalised():
    corpus_index, _ = build_blend_index([3.0, 1.0], 1000)
    scaled, _ = build_blend_index([0.75, 0.25], 1000)
    np.testing.assert_array_equal(corpus_index, scaled)
    assert np.bincount(corpus_index).tolist() == [750, 250]


@pytest.mark.parametrize("build", [build_blend_index, greedy_blend_index])
def test_output_types_and_running_count(build):
    weights = _dirichlet(30, 9)
    corpus_index, sample_index = build(weights, 50_000)
    assert corpus_index.dtype == np.int16 and sample_index.dtype == np.int64
    assert corpus_index.shape == sample_index.shape == (50_000,)
    order, rank = _running_count(corpus_index, 30)
    np.testing.assert_array_equal(sample_index[order], rank)
    empty_corpus, empty_sample = build(weights, 0)
    assert empty_corpus.dtype == np.int16 and empty_sample.dtype == np.int64
    assert empty_corpus.size == empty_sample.size == 0


@pytest.mark.parametrize(
    "weights",
    [[0.5, -0.5], [1.0, 0.0], [1.0, float("nan")], [1.0, float("inf")], [], [[0.5, 0.5]]],
    ids=["negative", "zero", "nan", "inf", "empty", "2-d"],
)
def test_bad_weights_are_rejected(weights):
    with pytest.raises(ValueError, match="weight"):
        build_blend_index(weights, 10)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_samples"):
        build_blend_index([1.0], -1)
    with pytest.raises(ValueError, match="corpora"):
        build_blend_index(np.ones(interleave.MAX_CORPORA + 1), 10)
    np.testing.assert_array_equal(build_blend_index([1e308, 1e308], 4)[0], [0, 1, 0, 1])
    with pytest.raises(ValueError, match="range"):
        build_blend_index([1e300, 1e-300], 10)  # the smallest underflows once normalised


@pytest.mark.parametrize("name", ["dirichlet-3", "dirichlet-100", "skewed", "many-tiny"])
def test_every_aligned_batch_is_within_two_samples(name):
    weights, num_samples = WEIGHT_SETS[name]
    corpus_index, _ = build_blend_index(weights, num_samples)
    for batch_size in (1, 7, 64, 256, 1000):
        assert max_batch_deviation(corpus_index, weights, batch_size).max() < 2


def test_max_batch_deviation_matches_brute_force_and_skips_the_partial_batch():
    rng = np.random.default_rng(10)
    weights = np.array([0.5, 0.3, 0.2])
    corpus_index = rng.integers(0, 3, size=1003).astype(np.int16)
    batches = corpus_index[:1000].reshape(100, 10)
    expected = np.array(
        [np.abs((batches == d).sum(axis=1) - 10 * weights[d]).max() for d in range(3)]
    )
    np.testing.assert_allclose(max_batch_deviation(corpus_index, weights, 10), expected)
    # Small chunks take the same path as 10^8 samples do.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interleave, "_CHUNK_CELLS", 64)
        np.testing.assert_allclose(max_batch_deviation(corpus_index, weights, 10), expected)
    assert max_batch_deviation(corpus_index[:9], weights, 10).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="outside"):
        max_batch_deviation(corpus_index, weights[:2], 10)


def test_greedy_baseline_is_the_classic_greedy_without_the_bound():
    weights = np.array([1.0] + [1e-3] * 50)
    greedy, _ = greedy_blend_index(weights, 2000)
    assert greedy.tolist() == _reference_greedy(weights, 2000)
    # Tied tiny corpora wait their turn by id, so the last ones fall almost 2 samples behind.
    with pytest.raises(AssertionError):
        _assert_prefix_bound(greedy, weights)
    edf, _ = build_blend_index(weights, 2000)
    _assert_prefix_bound(edf, weights)


def test_fallback_keeps_going_when_nothing_is_released():
    # Weights summing to 1/2 release items half as often as slots come: only the fallback fills
    # the gaps. Unreachable through the public API, which normalises.
    corpus_index, sample_index = interleave._outputs(100)
    fallbacks = interleave._run(
        "goodput_edf_interleave", np.array([0.25, 0.25]), corpus_index, sample_index
    )
    assert fallbacks > 0
    order, rank = _running_count(corpus_index, 2)
    np.testing.assert_array_equal(sample_index[order], rank)


def test_missing_extension_names_the_fix(monkeypatch):
    monkeypatch.setattr(importlib.machinery, "EXTENSION_SUFFIXES", [".not-built.so"])
    interleave._library.cache_clear()
    try:
        with pytest.raises(GoodputError, match="pip install -e"):
            build_blend_index([1.0], 10)
    finally:
        interleave._library.cache_clear()
