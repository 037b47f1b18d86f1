"""Fuzz ``goodput.runfiles``: any bytes as metrics.jsonl or evals.jsonl, and any JSON value under
the schema's keys, give parsed lines whose accessors never fail, or one GoodputError line; any
record the trainer could write parses back to what it wrote."""

import json
import math
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput import runfiles
from goodput.testing import fuzz

values = fuzz.json_values(0, 1, -1, 2.5, 1e300, 1 << 62, 10**400, True, "x", "partner")
step_objects = st.dictionaries(
    st.sampled_from([*runfiles.STEP_KEYS, "loss_z", "acc/arc"]), values, max_size=8
)
eval_objects = st.dictionaries(st.sampled_from([*runfiles.EVAL_KEYS, "extra"]), values)


def read_file(read, data: bytes) -> list | None:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "run.jsonl"
        path.write_bytes(data)
        return fuzz.result_or_refusal(lambda: list(read(path)))


@given(st.binary(max_size=400))
def test_any_bytes(data):
    for line in read_file(runfiles.read_steps, data) or []:
        assert all(math.isfinite(value) for value in line.numbers().values())
    read_file(runfiles.read_evals, data)


@given(step_objects, st.sets(st.sampled_from(list(runfiles.STEP_KEYS)), max_size=3))
def test_any_values_under_the_step_keys(raw, require):
    parse = lambda: runfiles.parse_step(raw, "metrics.jsonl:1", require=require)  # noqa: E731
    line = fuzz.result_or_refusal(parse)
    if line is not None:
        assert type(line.step) is int and 0 <= line.step < runfiles.MAX_COUNT
        assert set(require) <= set(line.raw)
        for key in runfiles.STEP_KEYS:
            number = line.number(key)  # never raises, whatever the kind admitted
            assert number is None or isinstance(number, float)


@given(eval_objects)
def test_any_values_under_the_eval_keys(raw):
    line = fuzz.result_or_refusal(runfiles.parse_eval, raw, "evals.jsonl:1")
    if line is not None:
        assert line.value is None or math.isfinite(line.value)
        assert json.loads(runfiles.evals_text([line], where="test")) == line.as_json()


floats = st.floats(allow_nan=True, allow_infinity=True)
counts = st.integers(0, runfiles.MAX_COUNT - 1)
seconds = st.floats(0, 1e12)
measured_keys = st.text(max_size=8).filter(lambda key: key not in runfiles.RECORD_KEYS)
records = st.builds(
    runfiles.StepRecord,
    step=counts, loss=floats, grad_norm=floats.map(abs), lr=seconds, tokens_per_s=seconds,
    tokens_per_s_per_device=seconds, mfu=st.none() | seconds, peak_memory_gib=seconds,
    step_time_s=seconds, skipped=st.booleans(), skipped_steps=counts, time=seconds,
    stage=counts, tokens=counts,
    measured=st.dictionaries(measured_keys, st.none() | floats | counts, max_size=4),
)  # fmt: skip


@given(records)
def test_what_the_trainer_could_write_parses_back(record):
    written = runfiles.nonfinite_as_null(record.as_json())
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "metrics.jsonl"
        path.write_text(runfiles.json_line(written, where=path))
        lines = fuzz.result_or_refusal(lambda: list(runfiles.read_steps(path)))
    # A measured key of the schema with a value outside its kind is refused; all else reads.
    if lines is None:
        measured = runfiles.MEASURED.keys() & written.keys()
        assert any(not runfiles.MEASURED[key].admits(written[key]) for key in measured)
    else:
        assert dict(lines[0].raw) == written
