"""Fuzz ``runfiles``' busy.jsonl schema: any bytes as the file and any JSON value under its keys
give windows that hold only what the schema admits, or one GoodputError line; every window the
trainer could write parses back to what it wrote."""

import math
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput import runfiles
from goodput.testing import fuzz

values = fuzz.json_values(0, 1, -1, 0.5, 1e300, 1 << 62, "nid1", True)
rows = st.lists(st.one_of(values, st.lists(values, min_size=4, max_size=4)), max_size=4)
objects = st.dictionaries(
    st.sampled_from([*runfiles.BUSY_KEYS, "extra"]), st.one_of(values, rows), max_size=4
)


def admitted(line: runfiles.BusyLine) -> None:
    assert line.step >= 0 and line.steps >= 1 and line.hosts
    for host in line.hosts:
        assert host.host and len(host.host) <= runfiles.MAX_NAME_CHARS
        assert all(math.isfinite(v) and v >= 0 for v in (host.mean_s, host.min_s, host.max_s))
        assert host.min_s <= host.max_s


@given(st.binary(max_size=400))
def test_any_bytes(data):
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "busy.jsonl"
        path.write_bytes(data)
        for line in fuzz.result_or_refusal(lambda: list(runfiles.read_busy(path))) or []:
            admitted(line)


@given(objects)
def test_any_values_under_the_keys(raw):
    line = fuzz.result_or_refusal(lambda: runfiles.parse_busy(raw, "busy.jsonl:1"))
    if line is not None:
        admitted(line)


seconds = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@st.composite
def host_rows(draw: st.DrawFn) -> runfiles.HostBusy:
    low, mean, high = sorted(draw(st.lists(seconds, min_size=3, max_size=3)))
    name = draw(st.from_regex(r"[a-z][a-z0-9.-]{0,30}", fullmatch=True))
    return runfiles.HostBusy(name, mean, low, high)


@given(
    step=st.integers(min_value=1, max_value=2**53),
    steps=st.integers(min_value=2, max_value=10_000),
    hosts=st.lists(host_rows(), min_size=1, max_size=20),
)
def test_a_written_window_reads_back(step, steps, hosts):
    line = runfiles.BusyLine(step=step, steps=steps, hosts=tuple(hosts))
    text = runfiles.json_line(line.as_json(), where="busy.jsonl")
    raw = fuzz.strict_json(text)
    assert runfiles.parse_busy(raw, "busy.jsonl:1") == line
