"""Fuzz the comparison's pure functions (``report.compare``) with hypothesis: the tokens axis of
any step lines (a result that rises with the step, or one ``GoodputError``), the trailing mean,
and ``first_reach`` and ``reaches`` on random series."""

import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from goodput.errors import MAX_RENDERED_CHARS, GoodputError
from goodput.report.compare import (
    LOSS,
    ComparedRun,
    Series,
    first_reach,
    reaches,
    tokens_by_step,
    trailing_mean,
)
from goodput.report.run_files import Step

fuzzed = settings(max_examples=200, derandomize=True, deadline=None, database=None)
values = st.floats(-1e6, 1e6, allow_nan=False)


@st.composite
def series(draw, min_size=1):
    """Points with strictly rising tokens."""
    gaps = draw(st.lists(st.integers(1, 1000), min_size=min_size, max_size=30))
    tokens = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    return [(t, draw(values)) for t in tokens]


@fuzzed
@given(series(), values, st.booleans())
def test_first_reach_is_the_first_point_at_or_past_the_target(points, target, higher):
    def meets(value):
        return value >= target if higher else value <= target

    found = first_reach(points, target, higher_is_better=higher)
    meeting = [tokens for tokens, value in points if meets(value)]
    assert found == (meeting[0] if meeting else None)
    if found is not None:
        assert all(not meets(value) for tokens, value in points if tokens < found)
    # A loss is an accuracy upside down.
    flipped = [(tokens, -value) for tokens, value in points]
    assert first_reach(flipped, -target, higher_is_better=not higher) == found


@fuzzed
@given(series(), st.booleans())
def test_a_series_reaches_its_own_final_value(points, higher):
    found = first_reach(points, points[-1][1], higher_is_better=higher)
    assert found is not None and found <= points[-1][0]


@fuzzed
@given(series(), st.integers(1, 50_000))
def test_the_trailing_mean_stays_inside_its_window(points, window):
    smoothed = trailing_mean(points, window)
    assert [t for t, _ in smoothed] == [t for t, _ in points]
    slack = 1e-12 * max(abs(value) for _, value in points)  # the running sum's rounding
    for tokens, mean in smoothed:
        inside = [value for t, value in points if tokens - window < t <= tokens]
        assert min(inside) - slack <= mean <= max(inside) + slack
        assert math.isclose(mean, math.fsum(inside) / len(inside), rel_tol=1e-9, abs_tol=slack)
    assert trailing_mean(points, 1) == tuple(points)


# A line's tokens: a whole number (runfiles.COUNT), small, where a float of it rounds (2**53
# and on), or at the largest count; None: the line does not say.
line_tokens = st.one_of(
    st.none(), st.integers(0, 5000), st.integers(2**53 - 4, 2**53 + 4), st.just(2**62)
)


@fuzzed
@given(
    st.lists(st.tuples(st.integers(1, 5), line_tokens), max_size=20),
    st.one_of(st.none(), st.integers(1, 300)),
)
def test_the_tokens_axis_rises_with_the_step_or_is_refused(lines, tokens_per_step):
    steps, number = [], 0
    for index, (gap, tokens) in enumerate(lines):
        number += gap
        steps.append(Step(step=number, time=0.0, step_time_s=1.0, tokens=0, tokens_seen=tokens,
                          line=index + 1))  # fmt: skip
    try:
        placed, derived = tokens_by_step(steps, tokens_per_step, "m")
    except GoodputError as refused:
        assert len(refused.render()) <= MAX_RENDERED_CHARS and refused.where.startswith("m")
        return
    assert list(placed) == [s.step for s in steps]
    axis = list(placed.values())
    assert all(a < b for a, b in zip(axis, axis[1:], strict=False)) and all(t > 0 for t in axis)
    assert derived == any(s.tokens_seen is None for s in steps)
    for s in steps:  # exact: integers past 2**53 too
        assert placed[s.step] == (
            s.step * tokens_per_step if s.tokens_seen is None else s.tokens_seen
        )


@fuzzed
@given(st.lists(series(), min_size=2, max_size=4))
def test_every_ordered_pair_has_one_reach_per_series(losses):
    runs = [
        ComparedRun(f"r{i}", Path(f"r{i}"), False, {LOSS: Series(LOSS, tuple(points))})
        for i, points in enumerate(losses)
    ]
    found = reaches(runs)
    assert len(found) == len(runs) * (len(runs) - 1)
    for reach in found:
        run = runs[int(reach.run[1:])].series[LOSS]
        target = runs[int(reach.target_run[1:])].series[LOSS]
        assert reach.target == target.final[1] and reach.target_tokens == target.final[0]
        assert reach.tokens == first_reach(run.points, reach.target, higher_is_better=False)
        if reach.tokens is not None:
            assert reach.ratio == reach.target_tokens / reach.tokens
