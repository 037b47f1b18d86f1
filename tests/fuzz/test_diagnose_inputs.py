"""Fuzz the files ``goodput diagnose batch-size`` reads from outside (a run's metrics.jsonl and
config.toml) and the LR range test's curve analysis.

Properties: any bytes as a metrics file, any JSON value in a metrics line's ``step`` or
``gns``, and any bytes as a config give a result or one ``GoodputError`` line, never another
exception; a result only ever holds usable (finite, > 0) estimates, and its ``--json`` is
strict JSON (no ``NaN``/``Infinity``) with both efficiencies in [0, 1], whatever the numbers (down
to subnormal, up to float's limit, or an integer past it). Any curve of finite or missing
smoothed losses gives regions in order, each inside the ramp, and a suggestion inside the ramp;
any losses and gradient norms a ramp's steps return give an lr-find result that is strict JSON.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput import argtypes
from goodput.diagnose.batch_size import read_estimates, report
from goodput.diagnose.lr_find import Curve, RampSettings
from goodput.diagnose.lr_regions import find_regions, ramp
from goodput.io import json_text
from goodput.runfiles import read_tokens_per_step
from goodput.testing.fuzz import json_values, result_or_refusal, strict_json

CONFIG = '[train]\ntokens_per_step = 4096\nrun_dir = "run"\n'


def _run_dir(folder: Path, metrics: bytes, config: bytes = CONFIG.encode()) -> Path:
    (folder / "config.toml").write_bytes(config)
    (folder / "metrics.jsonl").write_bytes(metrics)
    return folder


def _check_estimates(estimates) -> None:
    if estimates is not None:
        assert all(math.isfinite(v) and v > 0 for v in estimates.by_step.values())


@given(st.binary(max_size=2000))
def test_any_bytes_as_metrics(data):
    with tempfile.TemporaryDirectory() as folder:
        run = _run_dir(Path(folder), data)
        _check_estimates(result_or_refusal(read_estimates, run / "metrics.jsonl"))
        result_or_refusal(report, run)


@given(st.lists(st.text(max_size=60), max_size=12), st.booleans())
def test_any_text_lines_as_metrics(lines, final_newline):
    text = "\n".join(lines) + ("\n" if final_newline else "")
    with tempfile.TemporaryDirectory() as folder:
        run = _run_dir(Path(folder), text.encode())
        result_or_refusal(report, run)


@given(st.lists(st.tuples(json_values(), json_values(1.5, -2.0, 1e308)), max_size=8))
def test_any_json_values_as_step_and_gns(pairs):
    lines = [json.dumps({"step": step, "gns": gns}) for step, gns in pairs]
    lines += [json.dumps({"step": i, "gns": 100.0 * (i + 1)}) for i in range(3)]
    with tempfile.TemporaryDirectory() as folder:
        run = _run_dir(Path(folder), ("\n".join(lines) + "\n").encode())
        _check_estimates(result_or_refusal(read_estimates, run / "metrics.jsonl"))
        _check_report(result_or_refusal(report, run))


# Numbers a gns or a global batch might be: anything a float holds, subnormals, float's limit,
# and integers past it.
hostile_numbers = (
    st.floats()
    | st.floats(min_value=0, max_value=1e-300)
    | st.floats(min_value=1e300)
    | st.integers(min_value=-(2**1100), max_value=2**1100)
)


@given(st.lists(hostile_numbers, min_size=1, max_size=12), hostile_numbers)
def test_any_numbers_as_gns_and_global_batch_give_strict_json(values, global_batch):
    lines = [json.dumps({"step": step, "gns": gns}) for step, gns in enumerate(values)]
    config = f"[train]\ntokens_per_step = {json.dumps(global_batch)}\n"
    with tempfile.TemporaryDirectory() as folder:
        run = _run_dir(Path(folder), ("\n".join(lines) + "\n").encode(), config.encode())
        _check_report(result_or_refusal(report, run))


def _check_report(found) -> None:
    if found is None:
        return
    printed = strict_json(json_text(found.as_json(), where="test"))
    step, data = printed["step_efficiency"], printed["data_efficiency"]
    assert 0 <= step <= 1 and 0 <= data <= 1 and math.isclose(step + data, 1)
    low, high = printed["recommended_tokens"]
    assert 0 < low < high


@given(st.binary(max_size=500) | st.text(max_size=200).map(str.encode))
def test_any_bytes_as_config(data):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.toml"
        path.write_bytes(data)
        value = result_or_refusal(read_tokens_per_step, path)
        assert value is None or (isinstance(value, int) and value > 0)


smoothed_values = st.none() | st.floats(min_value=0, max_value=1e6) | st.just(math.nan)


@given(
    st.lists(smoothed_values, min_size=2, max_size=60),
    st.booleans(),
    st.floats(1e-9, 1e-3),
    st.floats(1.5, 1e9),
)
def test_any_curve_gives_ordered_regions_inside_the_ramp(smoothed, stopped_early, low, factor):
    lrs = ramp(low, low * factor, len(smoothed))
    regions = find_regions(lrs, smoothed, stopped_early)
    assert lrs[0] <= regions.suggested_lr <= lrs[-1]
    present = [r for r in (regions.plateau, regions.basin, regions.cliff) if r is not None]
    assert present
    for lo, hi in present:
        assert lrs[0] <= lo <= hi <= lrs[-1]
    for (_, hi), (lo, _) in zip(present, present[1:], strict=False):
        assert hi < lo
    if regions.basin is not None:
        assert regions.basin[0] <= regions.suggested_lr <= regions.basin[1]


losses = st.floats() | st.floats(min_value=1e300) | st.floats(min_value=-1e308, max_value=-1e300)


lrs = st.floats(min_value=0, max_value=argtypes.MAX_SECONDS, exclude_min=True)


@given(st.lists(st.tuples(losses, losses, st.booleans()), min_size=1, max_size=40), lrs, lrs)
def test_any_ramp_steps_give_a_strict_json_result(steps, min_lr, max_lr):
    settings = result_or_refusal(RampSettings, 40, min_lr, max_lr)
    if settings is None:  # an lr pair the options refuse
        return
    curve = Curve()
    for lr, (loss, grad_norm, skipped) in zip(
        ramp(settings.min_lr, settings.max_lr, settings.num_steps), steps, strict=False
    ):
        if curve.add(lr, loss, grad_norm, skipped=skipped):
            break
    result = curve.result(settings)
    printed = strict_json(json_text(result.as_json(), where="test"))
    lrs = [point["lr"] for point in printed["curve"]]
    assert lrs[0] <= printed["suggested_lr"] <= settings.max_lr
    assert printed["stopped_early"] == (len(lrs) < settings.num_steps)
