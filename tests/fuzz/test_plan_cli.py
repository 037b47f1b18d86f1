"""Fuzz the numbers ``goodput plan layout`` reads from its command line (hosts, devices per
host, device memory, the global batch, the sequence length, the micro-batch and the step
cost's rates; with any device, checkpointing mode, fp8 scaling and compile setting) and those
of ``goodput plan reliability`` (hosts, MTBF, stall, restart, walltime, survival, step,
interval).

Property: exit 0 with a plan, or exit 1 (nothing fits) or 2 (bad input) with exactly one
``goodput: error:`` line and no traceback, within a bound of time; never another exception, nor
the internal error's line. Every layout option is also tried at the ends of its documented
range, just past them and at the float extremes.
The failure budget's ``--json`` is strict JSON (no ``NaN``/``Infinity``) with every probability
in [0, 1], for any values the options admit, down to subnormal seconds.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import time

from hypothesis import given
from hypothesis import strategies as st

from goodput import argtypes, cli
from goodput.commands import plan as plan_command
from goodput.errors import DEBUG_HINT
from goodput.testing.fuzz import strict_json
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
    "--nhosts": st.integers(1, 300),
    "--ppn": st.integers(1, 16),
    "--gpu-mem-gb": st.floats(0.001, 200),
    "--gbs-tokens": st.integers(1, 2**12).map(lambda samples: samples * 256),
    "--seq-len": st.sampled_from([32, 64, 128, 256]),
    "--tflops": st.floats(1e-3, 1e4),
    "--intra-gbps": st.floats(1e-3, 1e4),
    "--inter-gbps": st.floats(1e-3, 1e4),
}


@given(
    config=st.sampled_from(["configs/tiny-cpu.toml", "configs/moe-small.toml"]),
    values=st.fixed_dictionaries(PLAUSIBLE),
    broken=st.sampled_from([None, *PLAUSIBLE]),
    junk=numbers,
    micro_batch=st.none() | st.integers(1, 8),
    checkpointing=st.sampled_from(
        [
            None,
            "--activation-checkpointing",
            "--no-activation-checkpointing",
            *(f"--activation-checkpointing={mode}" for mode in (*plan_command.AC_MODES, "any")),
        ]
    ),
    from_config=st.booleans(),
    rungs=st.fixed_dictionaries(
        {
            "--device": st.none() | st.sampled_from(plan_command.DEVICE_NAMES),
            "--fp8": st.none() | st.sampled_from([*plan_command.FP8_RECIPES, "any", "none"]),
            "compile": st.sampled_from([None, "--compile", "--no-compile"]),
        }
    ),
)
def test_any_numbers_give_a_plan_or_one_line(
    config, values, broken, junk, micro_batch, checkpointing, from_config, rungs
):
    if broken is not None:
        values[broken] = junk
    if rungs["--device"] is not None and broken != "--gpu-mem-gb":
        del values["--gpu-mem-gb"]  # the device's memory
    argv = ["plan", "layout", config]
    for option, value in values.items():
        argv.append(f"{option}={value}")  # '=' keeps a leading '-' a value
    if micro_batch is not None:
        argv.append(f"--micro-batch-size={micro_batch}")
    if checkpointing:
        argv.append(checkpointing)
    if from_config:
        argv.append("--layout-from-config")
    argv += [
        f"{option}={value}" for option, value in rungs.items() if value and option != "compile"
    ]
    argv += [rungs["compile"]] if rungs["compile"] else []
    _check_layout(argv)


def _check_layout(argv: list[str]) -> None:
    """Run ``goodput ARGV`` (a plan layout) in the repository: a plan within ``MAX_SECONDS`` (with
    --json strict JSON), or exit 1 (nothing fits) or 2 (bad input) with one error line."""
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
    if "--json" in argv and out.getvalue():  # a plan, or the candidates beside the error
        assert strict_json(out.getvalue())["layout"] is not None or code == 1, argv
    elif code == 0:
        assert out.getvalue().splitlines()[-1].startswith(("overrides: ", "warning: "))
    if code:
        assert code in (1, 2), (argv, err.getvalue())
        assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("goodput: error: ")
        assert "Traceback" not in err.getvalue()
        assert DEBUG_HINT not in err.getvalue(), argv  # the internal error's line: not input's


# Each option at the ends of its documented range, just past them, and at the float extremes
# (a subnormal, the largest double): the machine's maxima, rates from the smallest to the
# largest the model answers, memory from a subnormal to MAX_SECONDS GiB.
COUNT = argtypes.MAX_COUNT
rates = [5e-324, plan_command.MIN_RATE, plan_command.MAX_RATE, 2 * plan_command.MAX_RATE, 1.8e308]
EXTREMES = {
    "--nhosts": [1, 2, plan_command.MAX_NODES, plan_command.MAX_NODES + 1],
    "--ppn": [1, 12, plan_command.MAX_GPUS_PER_NODE, plan_command.MAX_GPUS_PER_NODE + 1],
    "--gpu-mem-gb": [5e-324, 1e-3, 80, argtypes.MAX_SECONDS, 1.8e308],
    "--gbs-tokens": [128, 256 * 2**20, COUNT // 256 * 256, COUNT, COUNT + 1],
    "--seq-len": [1, 2, 128, 256, 257, COUNT],
    "--micro-batch-size": [1, COUNT, COUNT + 1],
    "--tflops": rates,
    "--intra-gbps": rates,
    "--inter-gbps": rates,
}


# A machine and batch that plan; each example moves up to three options to their extremes.
USUAL = {
    "--nhosts": 2,
    "--ppn": 4,
    "--gpu-mem-gb": 80,
    "--gbs-tokens": 8192,
    "--seq-len": 128,
    "--micro-batch-size": 1,
}
extremes = st.sampled_from(list(EXTREMES)).flatmap(
    lambda option: st.tuples(st.just(option), st.sampled_from(EXTREMES[option]))
)


@given(
    config=st.sampled_from(["configs/tiny-cpu.toml", "configs/moe-small.toml"]),
    moved=st.lists(extremes, max_size=3),
    checkpointing=st.sampled_from([None, "--activation-checkpointing"]),
    as_json=st.booleans(),
)
def test_every_option_at_its_extremes_gives_a_plan_or_one_line_in_time(
    config, moved, checkpointing, as_json
):
    values = {**USUAL, **dict(moved)}
    argv = ["plan", "layout", config, *(f"{option}={value}" for option, value in values.items())]
    argv += [checkpointing] if checkpointing else []
    argv += ["--json"] if as_json else []
    _check_layout(argv)


RELIABILITY = {
    "--nhosts": st.integers(1, 2**17),
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
    _check_failure_budget(values)


# Every value the options admit (argtypes' ranges), extremes and subnormals included.
seconds = st.floats(min_value=0, max_value=argtypes.MAX_SECONDS, exclude_min=True)
IN_RANGE = {
    "--nhosts": st.integers(1, argtypes.MAX_COUNT),
    "--node-mtbf-days": seconds,
    "--save-stall-s": seconds,
    "--restart-s": st.just(0.0) | seconds,
    "--walltime-h": seconds,
    "--survival": seconds,
    "--step-s": seconds,
    "--interval-steps": st.integers(1, argtypes.MAX_COUNT),
}


@given(
    values=st.fixed_dictionaries(IN_RANGE),
    dropped=st.sampled_from([None, "--step-s", "--interval-steps"]),
)
def test_any_admitted_values_give_strict_json_or_one_line(values, dropped):
    values.pop(dropped, None)
    _check_failure_budget(values)


def _check_failure_budget(values: dict[str, object]) -> None:
    """Run the failure budget with ``values`` as --json: strict JSON with probabilities in
    [0, 1], or one usage line."""
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
        report = strict_json(out.getvalue())
        for key in ("expected_goodput", "configured_goodput", "spare_nodes_survival"):
            assert report[key] is None or 0 <= report[key] <= 1, (argv, key, report[key])
        assert report["spare_nodes"] >= 0 and report["optimal_interval_s"] > 0, argv
        steps = report["optimal_interval_steps"]
        assert steps is None or 0 < steps <= argtypes.MAX_COUNT, argv
        assert math.isfinite(report["failures_per_day"])
    else:
        assert code == 2, (argv, err.getvalue())
        assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("goodput: error: ")
        assert DEBUG_HINT not in err.getvalue(), argv
