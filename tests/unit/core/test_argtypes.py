"""Command-line number types refuse what is outside their range and say which range: a finite
10**9 seconds is "not in [0, 315360000]", never "not a finite number"."""

import argparse
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from goodput import argtypes


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (argtypes.non_negative_float, "1e9", "1e9 is not in [0, 315360000]"),
        (argtypes.positive_float, "0", "0 is not in (0, 315360000]"),
        (argtypes.positive_float, "nan", "nan is not in (0, 315360000]"),
        (argtypes.positive_float, "-inf", "-inf is not in (0, 315360000]"),
        (argtypes.positive_float, "x", "'x' is not a number"),
        (argtypes.positive_int, "0", "0 is not in [1, 1099511627776]"),
        (argtypes.integer(10, 100), "101", "101 is not in [10, 100]"),
        (argtypes.number(0.5, 2.0, low_open=True), "0.5", "0.5 is not in (0.5, 2]"),
    ],
)
def test_a_value_out_of_range_names_the_range(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as error:
        parse(text)
    assert str(error.value) == message


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_number_is_returned_exactly_when_it_is_in_the_stated_range(value):
    parse = argtypes.number(0.0, argtypes.MAX_SECONDS, low_open=False)
    inside = 0.0 <= value <= argtypes.MAX_SECONDS
    try:
        assert parse(repr(value)) == value and inside
    except argparse.ArgumentTypeError as error:
        assert not inside and "is not in [0, 315360000]" in str(error)


def test_the_command_line_states_the_range():
    run = subprocess.run(
        [sys.executable, "-m", "goodput", "plan", "reliability", "--nhosts", "1"]
        + ["--node-mtbf-days", "1", "--restart-s", "1", "--save-stall-s", "1e9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "argument --save-stall-s: 1e9 is not in (0, 315360000]" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
