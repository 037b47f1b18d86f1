"""Fuzz the one line reader (``goodput.io.read_lines``) and the one JSON-lines reader of run files
(``read_json_lines``) on any bytes and any line bound.

Properties: the lines read are exactly the file's lines (``b"\\n"`` kept, the last one without it
when the file does not end in one), numbered from 1, or, at the first line longer than the bound,
one ``GoodputError`` naming ``FILE:LINE``; passing over long lines yields exactly the others, with
their own numbers; and a JSON-lines file gives objects of its whole lines or one error naming a
line of it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.io import read_json_lines, read_lines

# Few distinct bytes, so newlines, blank lines and long runs without one all come up often.
contents = st.lists(
    st.binary(max_size=40) | st.sampled_from([b"\n", b"\n\n", b"\r\n", b"{}", b'{"a": 1}']),
    max_size=12,
).map(b"".join)
bounds = st.integers(1, 48)


def _file_lines(content: bytes) -> list[bytes]:
    """The file's lines as ``readline`` defines them: each ends at its b"\\n", kept."""
    lines = content.split(b"\n")
    whole = [line + b"\n" for line in lines[:-1]]
    return whole + ([lines[-1]] if lines[-1] else [])


def _written(folder: str, content: bytes) -> Path:
    path = Path(folder) / "lines"
    path.write_bytes(content)
    return path


@given(contents, bounds)
def test_the_lines_read_are_the_files_lines_or_the_first_long_one_is_named(content, bound):
    expected = list(enumerate(_file_lines(content), 1))
    too_long = [number for number, line in expected if len(line.rstrip(b"\n")) > bound]
    with tempfile.TemporaryDirectory() as folder:
        path = _written(folder, content)
        try:
            found = list(read_lines(path, bound, fix="fix"))
        except GoodputError as error:
            assert too_long and error.where == f"{path}:{too_long[0]}"
            assert f"longer than {bound:,} bytes" in error.what
        else:
            assert not too_long and found == expected


@given(contents, bounds)
def test_passing_over_long_lines_keeps_the_others_and_their_numbers(content, bound):
    expected = [
        (number, line)
        for number, line in enumerate(_file_lines(content), 1)
        if len(line.rstrip(b"\n")) <= bound
    ]
    with tempfile.TemporaryDirectory() as folder:
        found = list(read_lines(_written(folder, content), bound, fix="fix", skip_long=True))
    assert found == expected


@given(contents, st.integers(1, 12))
def test_a_line_count_past_the_bound_is_refused(content, max_lines):
    num_lines = len(_file_lines(content))
    with tempfile.TemporaryDirectory() as folder:
        path = _written(folder, content)
        try:
            found = list(read_lines(path, 1 << 10, fix="fix", max_lines=max_lines))
        except GoodputError as error:
            assert num_lines > max_lines and error.where == str(path)
        else:
            assert len(found) == num_lines <= max_lines


json_lines = st.lists(
    st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), max_size=3).map(
        lambda value: json.dumps(value).encode() + b"\n"
    )
    | st.binary(max_size=30),
    max_size=6,
).map(b"".join)


@given(json_lines, st.integers(2, 64))
def test_json_lines_give_the_objects_of_whole_lines_or_one_error_naming_a_line(content, bound):
    lines = _file_lines(content)
    with tempfile.TemporaryDirectory() as folder:
        path = _written(folder, content)
        try:
            found = list(read_json_lines(path, bound, fix="fix"))
        except GoodputError as error:
            assert "\n" not in error.render()
            number = int(error.where.removeprefix(f"{path}:"))
            assert 1 <= number <= len(lines)
        else:
            whole = [json.loads(line) for line in lines if line.endswith(b"\n") and line.strip()]
            assert [value for _where, value in found] == whole
