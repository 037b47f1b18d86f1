"""Fuzz the smoke record (``goodput diagnose smoke --baseline FILE``), a file from outside.

Properties: any bytes read as a record give a record or one usage ``GoodputError`` naming the
file, never another exception; a valid record with any field (top level, environment, a step)
set to any JSON value, or missing, is read or refused the same way; and whatever the writer
writes reads back with the same float64 bits.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.diagnose.smoke_record import (
    ENVIRONMENT_LABELS,
    METRICS,
    SmokeRecord,
    StepValues,
    read_record,
    write_record,
)
from goodput.errors import ExitCode, GoodputError
from goodput.launch.env import MAX_RANKS
from goodput.testing.fuzz import json_values, result_or_refusal

CONFIG = '[model]\ndim = 32\n\n[train]\nsteps = 2\nrun_dir = "(not compared)"\n'
VALID = {
    "format": "goodput-smoke",
    "version": 2,
    "world_size": 2,
    "config": CONFIG.splitlines(),
    "environment": {key: "x" for key in ENVIRONMENT_LABELS},
    "steps": [
        {"step": 1, "loss": 4.1, "grad_norm": 1.5, "peak_memory_gib": 0.5},
        {"step": 2, "loss": 4.0, "grad_norm": 1.25, "peak_memory_gib": 0.5},
    ],
}
# (path into VALID, as keys and list indices)
PLACES = [
    *[(key,) for key in VALID],
    *[("environment", key) for key in ENVIRONMENT_LABELS],
    *[("steps", index, key) for index in (0, 1) for key in VALID["steps"][0]],
    ("config", 0),
]
FINITE = st.floats(min_value=0, allow_nan=False, allow_infinity=False)


def _read(data: bytes) -> SmokeRecord | None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "baseline.json"
        path.write_bytes(data)
        try:
            return read_record(path)
        except GoodputError as error:
            assert error.code == ExitCode.USAGE and error.where.startswith(str(path))
            assert "\n" not in error.render()
            return None


@given(st.binary(max_size=2000) | json_values().map(lambda value: json.dumps(value).encode()))
def test_any_file_is_a_record_or_one_line_naming_it(data):
    _read(data)


@given(st.sampled_from(PLACES), json_values() | st.just(KeyError))
def test_any_value_anywhere_is_read_or_refused(place, value):
    record = json.loads(json.dumps(VALID))
    container = record
    for key in place[:-1]:
        container = container[key]
    if value is KeyError:
        del container[place[-1]]
    else:
        container[place[-1]] = value
    result = result_or_refusal(_read, json.dumps(record).encode())
    assert result is None or isinstance(result, SmokeRecord)


steps = st.lists(st.tuples(FINITE, FINITE, FINITE), min_size=1, max_size=20).map(
    lambda values: tuple(StepValues(i + 1, *v) for i, v in enumerate(values))
)
environments = st.fixed_dictionaries(
    {key: st.text(max_size=40).filter(str.isprintable) for key in ENVIRONMENT_LABELS}
)


@given(steps, environments)
def test_what_the_writer_writes_reads_back_bit_for_bit(steps, environment):
    written = SmokeRecord(config=CONFIG, world_size=1, environment=environment, steps=steps)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "record.json"
        write_record(path, written)
        read = read_record(path)
    assert read.config == written.config and read.environment == written.environment

    def bits(record):
        return [struct.pack("<d", getattr(s, m)) for s in record.steps for m in METRICS]

    assert [s.step for s in read.steps] == [s.step for s in written.steps]
    assert bits(read) == bits(written)


@given(st.integers(min_value=1, max_value=MAX_RANKS))
def test_any_world_size_the_writer_writes_reads_back(world_size):
    written = SmokeRecord(
        config=CONFIG,
        world_size=world_size,
        environment=dict.fromkeys(ENVIRONMENT_LABELS, "x"),
        steps=(StepValues(1, 4.1, 1.5, 0.5),),
    )
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "record.json"
        write_record(path, written)
        assert read_record(path) == written
