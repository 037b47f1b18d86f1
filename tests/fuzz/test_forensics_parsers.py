"""Fuzz the hang forensics' readers of what other processes wrote: the faulthandler text of a
rank's stack file (``forensics.parse_stack``) and a host's JSON answer (``read_report``), then
the naming over whatever reports get through (``suspects.name_suspects``).

Properties: ``parse_stack`` takes any text and returns at most 3 printable, bounded frames of the
thread asked for, never raising; ``read_report`` gives a report or one ``GoodputError``; any
valid report with any key of a rank set to any JSON value is read or refused the same way; and
every report that reads names suspects whose line is printable and bounded, on the planned hosts.
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from goodput import beacon
from goodput.launch.forensics import (
    MAX_FRAME_CHARS,
    TOP_FRAMES,
    HostReport,
    RankReport,
    parse_stack,
    read_report,
)
from goodput.launch.suspects import MAX_SAID_CHARS, name_suspects
from goodput.testing.fuzz import json_values, result_or_refusal

THREAD_IDS = st.integers(0, 2**64 - 1)
LINES = st.one_of(
    st.text(max_size=80),
    THREAD_IDS.map(lambda i: f"Current thread 0x{i:016x} (most recent call first):"),
    THREAD_IDS.map(lambda i: f"Thread 0x{i:x} [w] (most recent call first):"),
    st.tuples(st.text(max_size=40), st.integers(0, 10**9), st.text(max_size=40)).map(
        lambda t: f'  File "{t[0]}", line {t[1]} in {t[2]}'
    ),
)
VALID_RANK = {
    "rank": 0,
    "world_size": 2,
    "pid": 7,
    "schedule_id": 0,
    "step": 3,
    "phase": "data",
    "last_site": "step.tokens",
    "entered": 4,
    "left": 3,
    "flush_site": "",
    "flush_entered": 0,
    "flush_left": 0,
    "torn": False,
    "state": "running",
    "answered": True,
    "stack": ["faults.py:210 stall"],
}


@given(st.lists(LINES, max_size=30), THREAD_IDS)
def test_any_stack_text_parses_to_bounded_printable_frames(lines, thread_id):
    frames = parse_stack("\n".join(lines), thread_id)
    assert len(frames) <= TOP_FRAMES
    assert all(len(f) <= MAX_FRAME_CHARS and f.isprintable() for f in frames)


@given(st.binary(max_size=300) | st.text(max_size=300))
def test_any_bytes_are_a_report_or_a_refusal(data):
    result_or_refusal(read_report, data)


@given(st.sampled_from(sorted(VALID_RANK)), json_values(*beacon.PHASES, *beacon.SITES))
def test_any_value_of_any_key_is_read_or_refused(key, value):
    rank = {**VALID_RANK, key: value}
    report = result_or_refusal(
        read_report, json.dumps({"ranks": [rank], "problems": [], "omitted": 0})
    )
    if report is not None:
        _named_safely({"h0": report, "h1": None})


@st.composite
def rank_reports(draw: st.DrawFn) -> RankReport:
    entered = draw(st.integers(0, 20))
    return RankReport(
        rank=draw(st.integers(0, 3)),
        world_size=4,
        pid=draw(st.integers(1, 100)),
        schedule_id=draw(st.integers(0, 2)),
        step=draw(st.integers(0, 5)),
        phase=draw(st.sampled_from(beacon.PHASES)),
        last_site=draw(st.sampled_from(("", *beacon.SITES))),
        entered=entered,
        left=draw(st.integers(0, entered)),
        flush_site="",
        flush_entered=0,
        flush_left=0,
        torn=draw(st.booleans()),
        state=draw(st.sampled_from(("running", "stopped", "disk-sleep", "gone"))),
        answered=draw(st.booleans()),
        stack=tuple(draw(st.lists(st.text(max_size=20).filter(str.isprintable), max_size=3))),
    )


@given(st.lists(rank_reports(), max_size=8), st.booleans())
def test_any_reports_name_printable_suspects_on_planned_hosts(ranks, second_silent):
    report = HostReport(ranks=tuple(ranks))
    _named_safely({"h0": report, "h1": None if second_silent else report})


def _named_safely(reports: dict[str, HostReport | None]) -> None:
    findings = name_suspects(reports, ["h0", "h0", "h1", "h1"])
    assert findings.line.isprintable()
    for suspect in findings.suspects:
        assert suspect.host in ("h0", "h1") and suspect.source == "hang-suspect"
        assert suspect.said.isprintable() and len(suspect.said) <= MAX_SAID_CHARS
