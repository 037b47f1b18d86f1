"""Fuzz ``[profile] steps``: any two integers build a config exactly when they are a window of
1 to 100 steps from step 1 on, and are otherwise one usage line; the window a start traces is
the part of it between the start's first step and the run's last, never more."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.config import from_table
from goodput.errors import ExitCode, GoodputError
from goodput.train.config.profile import MAX_STEPS, ProfilerConfig
from goodput.train.profiling import build_profiler

steps = st.integers(min_value=-(2**60), max_value=2**60) | st.integers(min_value=-3, max_value=210)


@given(first=steps, last=steps)
def test_a_window_is_built_or_refused_in_one_line(first, last):
    valid = 1 <= first <= last < first + MAX_STEPS and last <= 2**53
    try:
        config = from_table(ProfilerConfig, {"steps": [first, last]}, "x.toml", "profile.")
    except GoodputError as error:
        assert not valid and error.code == ExitCode.USAGE
        assert "\n" not in error.render()
    else:
        assert valid and config.steps == (first, last)


@given(
    first=st.integers(1, 300),
    span=st.integers(0, MAX_STEPS - 1),
    first_step=st.integers(1, 400),
    last_step=st.integers(1, 400),
)
def test_a_start_traces_only_steps_it_runs_within_the_window(first, span, first_step, last_step):
    config = ProfilerConfig(steps=(first, first + span))
    # rank 1: says nothing; builds no trace until a step begins (nothing is started here)
    profiler = build_profiler(
        config, Path("/nonexistent"), rank=1, first_step=first_step, last_step=last_step
    )
    expected = (max(first, first_step), min(first + span, last_step))
    if expected[0] > expected[1]:
        assert profiler is None
    else:
        assert profiler is not None and profiler.window == expected
