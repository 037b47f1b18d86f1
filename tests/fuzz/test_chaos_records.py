"""Fuzz what a chaos campaign reads back from its runs (``goodput.chaos.records``): the step records
of ``metrics.jsonl``, the fault hooks' fired records and the resume lines of a launch log.

Properties: any file gives records or one ``GoodputError`` naming the file (and the line, for a
metrics line), never another exception; a valid record with any key set to any JSON value is
read or refused the same way; what the trainer and the hooks write reads back as written; and a
launch log of any bytes gives only the resume lines it holds.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.chaos import records
from goodput.errors import GoodputError
from goodput.faults import KINDS
from goodput.testing.fuzz import json_values, result_or_refusal

STEP = {"step": 3, "loss": 2.5, "grad_norm": None, "step_time_s": 0.1, "time": 1.7e9}
FIRED = {"id": 2, "kind": "kill", "step": 3, "rank": 1, "time": 1.7e9}


def _lines(values: list) -> bytes:
    return b"".join(json.dumps(value).encode() + b"\n" for value in values)


@given(st.one_of(st.binary(max_size=2000), st.lists(json_values(*STEP.values())).map(_lines)))
def test_any_metrics_file_reads_as_step_records_or_one_line_naming_it(data):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "metrics.jsonl"
        path.write_bytes(data)
        try:
            found = records.read_step_records(path)
        except GoodputError as error:
            assert "\n" not in error.render() and error.where.startswith(f"{path}:")
        else:
            assert all(isinstance(record, records.StepRecord) for record in found)


@given(st.sampled_from(sorted(STEP)), json_values())
def test_a_step_record_with_any_value_anywhere_is_read_or_refused(key, value):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "metrics.jsonl"
        path.write_text(json.dumps({**STEP, key: value}) + "\n")
        result_or_refusal(records.read_step_records, path)


@given(
    st.integers(1, 2**53),
    st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False)),
    st.floats(0, 1e6),
    st.floats(0, 4e9),
)
def test_what_the_trainer_writes_reads_back(step, loss, step_time_s, when):
    record = {**STEP, "step": step, "loss": loss, "step_time_s": step_time_s, "time": when}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "metrics.jsonl"
        path.write_text(json.dumps(record, allow_nan=False) + "\n")
        (found,) = records.read_step_records(path)
    assert found == records.StepRecord(step, loss, step_time_s, when)


@given(
    st.dictionaries(
        st.one_of(st.text(max_size=12), st.sampled_from(["0.json", "2.json", ".2.json.x.tmp"])),
        st.one_of(st.binary(max_size=200), json_values(*FIRED.values()).map(json.dumps)),
        max_size=4,
    )
)
def test_any_fired_folder_reads_as_records_or_one_line(files):
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        for name, content in files.items():
            if not name or "/" in name or "\0" in name or name in (".", ".."):
                continue
            try:
                path = directory / name
                path.write_bytes(content if isinstance(content, bytes) else content.encode())
            except OSError:  # a name this filesystem refuses
                continue
        found = result_or_refusal(records.read_fired, directory)
        assert found is None or all(record.kind in KINDS for record in found)


@given(st.sampled_from(sorted(FIRED)), json_values())
def test_a_fired_record_with_any_value_anywhere_is_read_or_refused(key, value):
    with tempfile.TemporaryDirectory() as folder:
        record = {**FIRED, key: value}
        Path(folder, "2.json").write_text(json.dumps(record))
        found = result_or_refusal(records.read_fired, Path(folder))
        assert found is None or found == [records.FiredRecord(**record)]


@given(
    st.lists(
        st.one_of(
            st.binary(max_size=200),
            st.tuples(
                st.integers(0, 10**15 - 1), st.integers(0, 10**9 - 1), st.integers(0, 99)
            ).map(
                lambda t: b"[rank0] resume: from /r/step-1 (step %d) loaded in %d.%02d s; ok" % t
            ),
        ),
        max_size=8,
    )
)
def test_a_launch_log_of_any_bytes_gives_its_resume_lines(lines):
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "launch.log"
        log.write_bytes(b"\n".join(lines))
        found = records.read_resume_loads(log)
    expected = [line for line in lines if line.startswith(b"[rank0] resume: from /r/step-1 (")]
    assert len(found) >= len(expected)
    assert all(load.step >= 0 and load.seconds >= 0 for load in found)
