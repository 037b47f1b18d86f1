"""Fuzz the one renderer of user-facing errors: whatever ``where``, ``what`` and ``fix`` quote
(paths of thousands of characters, newlines, Unicode line separators, any exception's message
or file name), an error is one line of bounded length, and argparse's errors are too."""

import contextlib
import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from goodput.commands import OneLineErrorParser
from goodput.errors import (
    ELISION,
    MAX_RENDERED_CHARS,
    MAX_WHAT_CHARS,
    GoodputError,
    from_exception,
    one_line,
)

# Text with the characters that break lines somewhere: \n \r \v \f \x1c-\x1e \x85 \u2028 \u2029.
BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029\t "
texts = st.text(max_size=60) | st.text(alphabet=st.sampled_from(BREAKS + "ab/"), max_size=60)
long_texts = st.builds(lambda part, count: part * count, texts, st.integers(0, 400))


def assert_one_bounded_line(line: str, limit: int = MAX_RENDERED_CHARS) -> None:
    assert len(line) <= limit
    assert len(line.splitlines()) <= 1 and not any(char in line for char in BREAKS[:-2])


@given(long_texts, long_texts, long_texts)
def test_any_error_renders_as_one_bounded_line(where, what, fix):
    error = GoodputError(where, what, fix)
    assert_one_bounded_line(error.render())
    assert str(error) == error.render()
    assert (error.where, error.what, error.fix) == (where, what, fix)  # the parts stay whole


@given(long_texts, st.integers(len(ELISION) + 2, 2_000))
def test_one_line_keeps_head_and_tail_of_a_long_text(text, limit):
    line = one_line(text, limit)
    folded = " ".join(text.split())
    assert_one_bounded_line(line, limit)
    if len(folded) <= limit:
        assert line == folded
    else:
        head, _, tail = line.partition(ELISION)
        assert folded.startswith(head) and folded.endswith(tail) and head and tail


@given(
    long_texts,
    st.one_of(st.none(), long_texts),
    st.sampled_from([ValueError, KeyError, TypeError, RuntimeError, OSError, MemoryError]),
)
def test_any_exception_becomes_one_bounded_line(message, filename, kind):
    if kind is OSError:
        exc: BaseException = OSError(2, message, filename)
    else:
        exc = kind(message)
    assert_one_bounded_line(from_exception(exc, context=message[:50]).render())


@given(long_texts)
def test_argparse_errors_are_one_bounded_line(value):
    parser = OneLineErrorParser(prog="goodput test")
    parser.add_argument("--count", type=int)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        parser.parse_args(["--count", value or "x"])
    line = err.getvalue().removesuffix("\n")
    assert exited.value.code == 2 and line.startswith("goodput: error: goodput test: ")
    assert_one_bounded_line(line, MAX_WHAT_CHARS + 100)
