"""Fuzz the files ``goodput diagnose batch-size`` reads from outside (a run's metrics.jsonl and
config.toml) and the LR range test's curve analysis.

Properties: any bytes as a metrics file, any JSON value in a metrics line's ``step`` or
``gns``, and any bytes as a config give a result or one ``GoodputError`` line, never another
exception; a result only ever holds usable (finite, > 0) estimates. Any curve of finite or
missing smoothed losses gives regions in order, each inside the ramp, and a suggestion inside
the ramp.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.diagnostics.batch_size import read_estimates, read_global_batch, report
from goodput.diagnostics.lr_regions import find_regions, ramp
from goodput.testing.fuzz import json_values, result_or_refusal

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
        found = result_or_refusal(report, run)
        if found is not None:
            json.dumps(found.as_json(), allow_nan=False)  # strict JSON out


@given(st.binary(max_size=500) | st.text(max_size=200).map(str.encode))
def test_any_bytes_as_config(data):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.toml"
        path.write_bytes(data)
        value = result_or_refusal(read_global_batch, path)
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
