"""Fuzz the straggler line's parser (``goodput.stragglers_line``): the launcher reads it from
any rank's output, so any text is input. Properties: it never raises and never reads past its
bound; whatever it accepts prints back to the same line; every notice ``line()`` writes (with
the values the line can hold) parses back to itself, after any prefix."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from goodput.stragglers_line import MARKER, MAX_LINE_CHARS, StragglerNotice, parse_notice

hosts = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,40}", fullmatch=True)
steps = st.integers(min_value=1, max_value=2**53)
hundredths = st.integers(min_value=0, max_value=10**9).map(lambda n: n / 100)
thousandths = st.integers(min_value=0, max_value=10**9).map(lambda n: n / 1000)


@st.composite
def notices(draw: st.DrawFn) -> StragglerNotice:
    first, last = sorted((draw(steps), draw(steps)))
    return StragglerNotice(
        rank=draw(st.integers(min_value=0, max_value=10**7)),
        host=draw(hosts),
        ratio=draw(hundredths),
        first_step=first,
        last_step=last,
        busy_s=draw(thousandths),
        median_s=draw(thousandths),
    )


@given(notice=notices(), prefix=st.sampled_from(["", "[rank0]: ", "0: ", "goodput: "]))
def test_a_notice_parses_back_to_itself(notice, prefix):
    assert parse_notice(prefix + notice.line()) == notice
    assert parse_notice(prefix + notice.line() + "\n") == notice


@given(text=st.text(max_size=2 * MAX_LINE_CHARS))
def test_any_text_parses_to_none_or_a_notice_that_prints_back(text):
    notice = parse_notice(text)
    if notice is not None:
        assert len(text) <= MAX_LINE_CHARS
        assert text[text.find(MARKER) :].rstrip() == notice.line()


@given(notice=notices(), tail=st.text(min_size=1, max_size=20).filter(lambda t: t.strip()))
def test_text_after_the_notice_is_refused(notice, tail):
    assert parse_notice(notice.line() + " " + tail) is None
