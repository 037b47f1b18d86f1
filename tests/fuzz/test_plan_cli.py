"""Fuzz the numbers ``goodput plan layout`` reads from its command line (nodes, devices per
node, device memory, the global batch, the sequence length and the micro-batch) and those of
``goodput plan reliability`` (nodes, MTBF, stall, restart, walltime, survival, step, interval).

Property: exit 0 with a plan, or exit 1 (nothing fits) or 2 (bad input) with exactly one
``goodput: error:`` line and no traceback, within a bound of time; never another exception.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import time

from hypothesis import given
from hypothesis import strategies as st

from goodput import cli
from goodput.testing.jobs import REPO

MAX_SECONDS = 5.0

numbers = st.one_of(
    st.integers(-3, 70).map(str),
    st.integers(1, 2**18).map(str),
    st.integers(-(2**62), 2**62).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.text("0123456789.-+eEx_ ", max_size=8),
)
# Values a real machine and batch might have; each example breaks at most one of them, so that
# most examples reach the planner.
PLAUSIBLE = {
    "--nodes": st.integers(1, 300),
    "--gpus-per-node": st.integers(1, 16),
    "--gpu-mem-gb": st.floats(0.001, 200),
    "--gbs-tokens": st.integers(1, 2**12).map(lambda samples: samples * 256),
    "--seq-len": st.sampled_from([32, 64, 128, 256]),
}


@given(
    config=st.sampled_from(["configs/tiny-cpu.toml", "configs/moe-small.toml"]),
    values=st.fixed_dictionaries(PLAUSIBLE),
    broken=st.sampled_from([None, *PLAUSIBLE]),
    junk=numbers,
    micro_batch=st.none() | st.integers(1, 8),
    checkpointing=st.booleans(),
)
def test_any_numbers_give_a_plan_or_one_line(
    config, values, broken, junk, micro_batch, checkpointing
):
    if broken is not None:
        values[broken] = junk
    argv = ["plan", "layout", config]
    for option, value in values.items():
        argv.append(f"{option}={value}")  # '=' keeps a leading '-' a value
    if micro_batch is not None:
        argv.append(f"--micro-batch-size={micro_batch}")
    if checkpointing:
        argv.append("--activation-checkpointing")
    out, err = io.StringIO(), io.StringIO()
    began, here = time.monotonic(), os.getcwd()
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as exit_:
                code = int(exit_.code or 0)
    finally:
        os.chdir(here)
    assert time.monotonic() - began < MAX_SECONDS, argv
    if code == 0:
        assert out.getvalue().splitlines()[-1].startswith(("overrides: ", "warning: "))
    else:
        assert code in (1, 2), (argv, err.getvalue())
        assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("goodput: error: ")
        assert "Traceback" not in err.getvalue()


RELIABILITY = {
    "--nodes": st.integers(1, 2**17),
    "--node-mtbf-days": st.floats(0.01, 3650),
    "--save-stall-s": st.floats(0.001, 3600),
    "--restart-s": st.floats(0, 3600),
    "--walltime-h": st.floats(0.01, 240),
    "--survival": st.floats(0.01, 0.9999),
    "--step-s": st.floats(0.01, 600),
    "--interval-steps": st.integers(1, 10**6),
}


@given(
    values=st.fixed_dictionaries(RELIABILITY),
    broken=st.sampled_from([None, *RELIABILITY]),
    junk=numbers,
    dropped=st.sampled_from([None, "--step-s", "--interval-steps"]),
)
def test_any_numbers_give_a_failure_budget_or_one_line(values, broken, junk, dropped):
    if broken is not None:
        values[broken] = junk
    values.pop(dropped, None)
    argv = ["plan", "reliability", *(f"{option}={value}" for option, value in values.items())]
    argv.append("--json")
    out, err = io.StringIO(), io.StringIO()
    began = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    assert time.monotonic() - began < MAX_SECONDS, argv
    if code == 0:
        report = json.loads(out.getvalue())
        assert 0 <= report["expected_goodput"] <= 1 and report["spare_nodes"] >= 0
        assert report["optimal_interval_s"] > 0 and math.isfinite(report["failures_per_day"])
    else:
        assert code == 2, (argv, err.getvalue())
        assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("goodput: error: ")
