"""Fuzz the report with numbers of every finite size: step lines, evals, busy time and the LR
finder's curve holding anything from float's smallest subnormal to its largest (both signs where
the field admits them), and tokens past 2**53, through every mean, sum and figure of the report:
one run's terminal summary, ``--json`` and figures (each one that draws these numbers), and two
runs compared (the table, its verdicts, ``--json`` and the page). Every file is one the run
files' schema admits, so the property is the stronger half of "a valid result or one
``GoodputError`` line": a result, whose verdicts and JSON hold only finite numbers, and every
figure drawn. (A line out of its domain is refused naming ``FILE:LINE``:
tests/fuzz/test_report_files.py, test_busy_lines.py and test_run_file_lines.py.)"""

import io
import json
import math
import re
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from goodput import rundir
from goodput.report.accounting import account
from goodput.report.compare import compare_runs, trailing_mean
from goodput.report.compare_views import (
    comparison_json,
    comparison_summary,
    reach_sentence,
    render_comparison_html,
)
from goodput.report.plots import PLOTS
from goodput.report.run_files import read_run
from goodput.report.sums import mean
from goodput.report.terminal import summary
from goodput.testing import fuzz

T0 = 1_800_000_000.0
BIGGEST = sys.float_info.max
EXTREMES = [0.0, 5e-324, sys.float_info.min, 1e-300, 1e-100, 0.5, 1.0, 3.0, 1e100, 1e300,
            1e307, BIGGEST / 2, BIGGEST]  # fmt: skip
magnitudes = st.sampled_from(EXTREMES) | st.floats(0, BIGGEST)
signed = magnitudes | magnitudes.map(lambda value: -value)
# Where a float of a count rounds (2**53 on), and the largest a line admits (runfiles.MAX_COUNT).
first_tokens = st.sampled_from([1, 2**53 - 2, 2**53, 2**62 - 100])
# The figures of the numbers drawn here (the timeline and the badput bar draw the account's,
# which tests/fuzz/test_report_accounting.py bounds; the mixtures are shares in [0, 1]).
FUZZED_FIGURES = {"loss", "grad-norm", "lr", "throughput", "accuracy", "lr-find", "busy"}
NOT_FINITE = re.compile(r"\b(inf|nan)\b", re.IGNORECASE)


@st.composite
def metrics_lines(draw: st.DrawFn) -> list[dict]:
    """Up to 6 steps, one a second, tokens rising by 1 to 3 from ``first_tokens``."""
    tokens = draw(first_tokens)
    lines = []
    for step in range(1, draw(st.integers(1, 6)) + 1):
        line = {"step": step, "time": T0 + step, "step_time_s": 1.0, "tokens": tokens,
                "loss": draw(signed)}  # fmt: skip
        for key in ("grad_norm", "lr", "tokens_per_s", "mfu"):
            line[key] = draw(magnitudes)
        if draw(st.booleans()):
            line["heldout_loss/web"] = draw(signed)
        lines.append(line)
        tokens += draw(st.integers(1, 3))
    return lines


@st.composite
def eval_lines(draw: st.DrawFn) -> list[dict]:
    lines = []
    for task, metric, value in (("heldout/web", "loss", signed), ("arc", "acc", signed),
                                ("arc", "chance", signed)):  # fmt: skip
        if draw(st.booleans()):
            stderr = draw(st.none() | magnitudes)
            lines.append({"step": 1, "task": task, "metric": metric, "value": draw(value),
                          "stderr": stderr, "source": "train"})  # fmt: skip
    return lines


@st.composite
def busy_lines(draw: st.DrawFn) -> list[dict]:
    windows = []
    for step in range(1, draw(st.integers(0, 3)) + 1):
        quantiles = sorted(draw(st.lists(magnitudes, min_size=5, max_size=5)))
        means = sorted(draw(st.lists(st.sampled_from(quantiles), min_size=0, max_size=2)))
        slowest = [
            [rank, f"nid{rank}", mean] for rank, mean in enumerate([quantiles[-1], *means[::-1]])
        ]
        windows.append(
            {"step": step, "steps": 1, "ranks": 3, "quantiles": quantiles, "slowest": slowest}
        )
    return windows


lr_find = st.none() | st.fixed_dictionaries(
    {
        "curve": st.lists(
            st.fixed_dictionaries({"lr": magnitudes, "smoothed_loss": signed}), max_size=4
        ),
        "suggested_lr": st.none() | magnitudes,
    }
)
runs = st.fixed_dictionaries(
    {"metrics": metrics_lines(), "evals": eval_lines(), "busy": busy_lines(), "lr_find": lr_find}
)


def jsonl(records: list) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


def write(run_dir: Path, files: dict) -> Path:
    run_dir.mkdir()
    (run_dir / rundir.METRICS).write_text(jsonl(files["metrics"]))
    (run_dir / rundir.EVALS).write_text(jsonl(files["evals"]))
    if files["busy"]:
        (run_dir / rundir.BUSY).write_text(jsonl(files["busy"]))
    if files["lr_find"] is not None:
        (run_dir / rundir.LR_FIND).write_text(json.dumps(files["lr_find"]))
    return run_dir


def shown(renderable: object) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


# Each example draws seven PNGs (about 0.15 s each): a quarter of the profile's examples keeps
# CI's share under 20 s and still scales with a longer campaign.
FIGURE_EXAMPLES = settings(max_examples=max(10, settings.default.max_examples // 4))


@FIGURE_EXAMPLES
@given(runs)
def test_one_run_summary_json_and_figures(files):
    with tempfile.TemporaryDirectory() as scratch:
        run = read_run(write(Path(scratch) / "run", files))
        acc = account(run)
        fuzz.strict_json(json.dumps(acc.as_json()))
        assert not NOT_FINITE.search(shown(summary(run, acc)))
        drawn = {plot.name: plot.draw(run, acc) for plot in PLOTS if plot.name in FUZZED_FIGURES}
        assert drawn["loss"] and drawn["throughput"]  # every step has a loss and a rate


@FIGURE_EXAMPLES
@given(runs, runs)
def test_two_runs_compared(first, second):
    with tempfile.TemporaryDirectory() as scratch:
        run_dirs = [write(Path(scratch) / "a", first), write(Path(scratch) / "b", second)]
        comparison = compare_runs(run_dirs)
        fuzz.strict_json(json.dumps(comparison_json(comparison)))
        for reach in comparison.reaches:  # a verdict speaks of finite numbers
            assert not NOT_FINITE.search(reach_sentence(reach))
        assert not NOT_FINITE.search(shown(comparison_summary(comparison)))
        assert render_comparison_html(comparison).count("<figure") >= 1


@st.composite
def loss_points(draw: st.DrawFn) -> list[tuple[int, float]]:
    """Up to 30 points of any finite value, tokens strictly rising."""
    gaps = draw(st.lists(st.integers(1, 1000), min_size=1, max_size=30))
    tokens = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    return [(t, draw(signed)) for t in tokens]


@given(loss_points(), st.integers(1, 50_000))
def test_the_trailing_mean_of_any_finite_values_is_finite_and_in_its_window(points, window):
    smoothed = trailing_mean(points, window)
    assert [t for t, _ in smoothed] == [t for t, _ in points]
    # The running sum's rounding: of the largest value (sums.headroom scales it exactly).
    slack = 1e-12 * max(abs(value) for _, value in points)
    for tokens, average in smoothed:
        inside = [value for t, value in points if tokens - window < t <= tokens]
        assert math.isfinite(average) and min(inside) - slack <= average <= max(inside) + slack
    assert trailing_mean(points, 1) == tuple(points)


@given(st.lists(signed, min_size=1, max_size=50))
def test_a_mean_of_any_finite_values_is_inside_them(values):
    found = mean(values)
    assert min(values) <= found <= max(values)
    exact = sum(Fraction(value) for value in values) / len(values)  # no rounding at all
    assert abs(Fraction(found) - exact) <= Fraction(max(map(abs, values))) * Fraction(1, 2**50)
