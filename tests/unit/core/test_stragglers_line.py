"""The straggler line: the exact text rank 0 prints, and what the parser refuses."""

from __future__ import annotations

import pytest

from goodput.stragglers_line import MAX_LINE_CHARS, StragglerNotice, parse_notice

NOTICE = StragglerNotice(
    rank=3, host="nid0012", ratio=1.62, first_step=12, last_step=31, busy_s=0.231, median_s=0.143
)
LINE = (
    "warning: straggler: rank 3 on nid0012 busy 1.62x the median over steps 12-31 "
    "(0.231 s vs 0.143 s)"
)


def test_the_line_is_the_documented_text_and_parses_back():
    assert NOTICE.line() == LINE
    assert parse_notice(LINE) == NOTICE
    assert parse_notice(f"[rank0]: {LINE}\r\n") == NOTICE


@pytest.mark.parametrize(
    "text",
    [
        "",
        "warning: straggler:",
        LINE.replace("steps 12-31", "steps 31-12"),  # a window that ends before it starts
        LINE.replace("steps 12-31", "steps 0-31"),  # steps count from 1
        LINE.replace("1.62x", "1.6x"),  # not the form line() writes
        LINE.replace("1.62x", "-1.62x"),
        LINE.replace("1.62x", "nan x"),
        LINE.replace("nid0012", "nid0012;rm"),
        LINE.replace("nid0012", "-nid"),
        LINE.replace("rank 3", "rank 12345678901234567"),  # 17 digits
        LINE + " and more",
        LINE.replace("\n", "") + " " * MAX_LINE_CHARS,  # past the bound: not read
        "x" * 10**6 + LINE,
    ],
)
def test_anything_else_is_not_a_notice(text):
    assert parse_notice(text) is None
