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

values = fuzz.json_values(0, 1, 3, -1, 0.5, 1e300, 1 << 62, "nid1", True)
rows = st.lists(st.one_of(values, st.lists(values, min_size=3, max_size=3)), max_size=4)
quantiles = st.one_of(
    values, st.lists(st.sampled_from([0, 0.5, 1, 1e300, -1, "x"]), min_size=5, max_size=5)
)
objects = st.dictionaries(
    st.sampled_from([*runfiles.BUSY_KEYS, "hosts", "extra"]),
    st.one_of(values, rows, quantiles),
    max_size=6,
)


def admitted(line: runfiles.BusyLine) -> None:
    assert line.step >= 0 and line.steps >= 1 and line.ranks >= 1
    assert all(math.isfinite(v) and v >= 0 for v in line.quantiles)
    assert list(line.quantiles) == sorted(line.quantiles)
    assert 1 <= len(line.slowest) <= min(runfiles.SLOWEST, line.ranks)
    assert len({row.rank for row in line.slowest}) == len(line.slowest)
    assert line.slowest[0].mean_s == line.quantiles[-1]
    for row, after in zip(line.slowest, [*line.slowest[1:], None], strict=True):
        assert 0 <= row.rank < line.ranks
        assert row.host and len(row.host) <= runfiles.MAX_NAME_CHARS
        assert line.quantiles[0] <= row.mean_s <= line.quantiles[-1]
        assert after is None or after.mean_s <= row.mean_s


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
def windows(draw: st.DrawFn) -> runfiles.BusyLine:
    """A window as the writer makes it: quantiles sorted, the slowest named from the top."""
    ranks = draw(st.integers(min_value=1, max_value=200_000))
    count = draw(st.integers(min_value=1, max_value=min(runfiles.SLOWEST, ranks)))
    named = draw(st.lists(st.integers(0, ranks - 1), min_size=count, max_size=count, unique=True))
    means = sorted(draw(st.lists(seconds, min_size=count, max_size=count)), reverse=True)
    low, p25, median, p75 = sorted(draw(st.lists(seconds, min_size=4, max_size=4)))
    low = min(low, means[-1])
    hosts = st.from_regex(r"[a-z][a-z0-9.-]{0,30}", fullmatch=True)
    return runfiles.BusyLine(
        step=draw(st.integers(min_value=1, max_value=2**53)),
        steps=draw(st.integers(min_value=1, max_value=10_000)),
        ranks=ranks,
        quantiles=(low, min(p25, means[0]), min(median, means[0]), min(p75, means[0]), means[0]),
        slowest=tuple(
            runfiles.RankBusy(rank, draw(hosts), mean)
            for rank, mean in zip(named, means, strict=True)
        ),
    )


@given(windows())
def test_a_written_window_reads_back(line):
    text = runfiles.json_line(line.as_json(), where="busy.jsonl")
    raw = fuzz.strict_json(text)
    assert runfiles.parse_busy(raw, "busy.jsonl:1") == line


@given(windows(), st.sampled_from(list(runfiles.BUSY_KEYS)), st.one_of(values, rows, quantiles))
def test_a_written_window_with_one_value_changed(line, key, value):
    raw = line.as_json() | {key: value}
    changed = fuzz.result_or_refusal(lambda: runfiles.parse_busy(raw, "busy.jsonl:1"))
    if changed is not None:
        admitted(changed)
