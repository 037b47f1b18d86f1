"""The fixed-size summary of one number per rank (``train.monitor.spread``), summed as a real
reduction sums it: the least and the most exact, with the slowest rank; a quantile within the bin
of the true value, and exact where the ranks there share one value."""

from __future__ import annotations

import math
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from goodput.train.monitor import spread

micros = st.integers(min_value=0, max_value=spread.MAX_US)
worlds = st.lists(micros, min_size=1, max_size=300)


def reduced(values: list[int]) -> spread.Spread:
    """What every rank reads after the SUM and the MAX over ranks holding ``values``."""
    bins = [sum(column) for column in zip(*map(spread.histogram, values), strict=True)]
    parts = [spread.extremes(us, rank) for rank, us in enumerate(values)]
    return spread.Spread.of(bins, [max(column) for column in zip(*parts, strict=True)])


@settings(max_examples=200, deadline=None)
@given(worlds)
def test_the_extremes_are_exact_and_the_median_within_its_bin(values):
    got = reduced(values)
    ordered = sorted(values)
    assert got.ranks == len(values)
    assert (got.min_s, got.max_s) == (ordered[0] / 1e6, ordered[-1] / 1e6)
    assert got.slowest_rank == values.index(ordered[-1])  # the least rank among equals
    middle = ordered[(len(values) - 1) // 2], ordered[len(values) // 2]
    low, high = (spread.bin_of(us) for us in middle)
    estimate = got.median_s * 1e6
    # A bin's mean is within the bin: between the least value of the lower middle's bin and
    # the most of the upper's (the bins are at most 1/8 of an octave wide).
    assert spread.bin_of(math.floor(estimate)) >= low or estimate >= middle[0] * 7 / 8
    assert spread.bin_of(math.floor(estimate)) <= high
    assert abs(estimate - statistics.median(values)) <= max(middle) / 8 + 1


@given(st.lists(st.sampled_from([0, 1, 999, 100_000, 100_007, 2_500_000]), min_size=1))
def test_ranks_sharing_a_value_give_it_exactly(values):
    distinct = sorted(set(values))
    alone_in_bins = len({spread.bin_of(us) for us in distinct}) == len(distinct)
    if alone_in_bins:
        assert reduced(values).median_s == statistics.median(values) / 1e6


@given(micros, st.integers(min_value=0, max_value=spread.MAX_RANKS - 1))
def test_a_packed_value_unpacks_and_orders_by_value_then_least_rank(us, rank):
    assert spread.unpack(spread.pack(us, rank)) == (us, rank)
    if rank > 0:
        assert spread.pack(us, rank - 1) > spread.pack(us, rank)
    if us < spread.MAX_US:
        assert spread.pack(us + 1, spread.MAX_RANKS - 1) > spread.pack(us, 0)
    assert spread.pack(0, spread.MAX_RANKS - 1) > spread.NOBODY


def test_bins_cover_every_time_in_order_and_clamp_what_is_past_them():
    edges = [0, 1, 2, 3, 7, 8, 15, 16, 1000, 10**6, spread.MAX_US]
    assert [spread.bin_of(us) for us in edges] == sorted(spread.bin_of(us) for us in edges)
    assert spread.bin_of(spread.MAX_US) == spread.BINS - 1
    assert spread.micros(1e9) == spread.MAX_US and spread.micros(-1.0) == 0
    assert spread.micros(0.15) == 150_000
