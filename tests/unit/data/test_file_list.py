"""File lists from outside: every bad weight, encoding or duplicate is one line naming file:line."""

import os
import shutil

import pytest

from goodput.data.blend import BlendSpec, BlendStage, build_blend
from goodput.data.file_list import corpus_weights, parse_file_list
from goodput.errors import GoodputError


def error_of(function, *args):
    with pytest.raises(GoodputError) as info:
        function(*args)
    message = info.value.render()
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        ("nan", "must be positive and finite"),
        ("inf", "must be positive and finite"),
        ("-inf", "must be positive and finite"),
        ("1e400", "must be positive and finite"),
        ("-0.5", "must be positive and finite"),
        ("0", "must be positive and finite"),
        ("0x10", "is not a number"),
        ("", "expected 3 fields"),
    ],
)
def test_bad_weights_name_file_and_line(three_corpora, weight, message):
    file_list, _ = three_corpora
    file_list.write_text(f"1 code code\n{weight} math math\n")
    assert error_of(parse_file_list, file_list).startswith(f"{file_list}:2: ")
    assert message in error_of(parse_file_list, file_list)


@pytest.mark.parametrize("loop", ["sub", "looped.bin"])
def test_a_loop_of_links_in_a_prefix_names_the_line_and_the_loop(three_corpora, loop):
    file_list, _ = three_corpora
    link = file_list.parent / loop
    link.symlink_to(link.name)
    prefix = "sub/x" if loop == "sub" else "looped"
    file_list.write_text(f"1 code code\n1 {prefix} loop\n")
    message = error_of(parse_file_list, file_list)
    assert message.startswith(f"{file_list}:2: '") and str(link) in message
    assert "Too many levels of symbolic links" in message


def test_weights_that_overflow_or_vanish_together_name_the_line(three_corpora):
    file_list, _ = three_corpora
    file_list.write_text("1e308 code code\n1e308 math math\n")
    message = error_of(corpus_weights, parse_file_list(file_list), file_list)
    assert message.startswith(f"{file_list}:2: ") and "more than a float can hold" in message
    file_list.write_text("1e300 code code\n1e-300 math math\n")
    message = error_of(corpus_weights, parse_file_list(file_list), file_list)
    assert message.startswith(f"{file_list}:2: ") and "corpus 'math' gets a share" in message


def test_invalid_utf8_names_the_file(three_corpora):
    file_list, _ = three_corpora
    file_list.write_bytes(b"1 code code\n1 math m\xffth\n")
    assert error_of(parse_file_list, file_list).startswith(f"{file_list}: is not valid UTF-8")


@pytest.mark.parametrize("link", ["symlink", "hardlink", "other path"])
def test_a_shard_reached_twice_is_refused_naming_both_lines(three_corpora, link):
    file_list, _ = three_corpora
    data = file_list.parent
    if link == "other path":
        second = f"{data}/../{data.name}/math"
    else:
        make = os.symlink if link == "symlink" else os.link
        for suffix in (".bin", ".idx"):
            make(data / f"math{suffix}", data / f"copy{suffix}")
        second = "copy"
    file_list.write_text(f"1 code code\n# a comment\n1 math math\n1 {second} web\n")
    message = error_of(parse_file_list, file_list)
    assert message.startswith(f"{file_list}:4: ")
    assert f"is the same file as '{data / 'math'}' on {file_list}:3" in message


def test_a_byte_identical_copy_is_refused_naming_both_lines(three_corpora, tmp_path):
    file_list, _ = three_corpora
    data = file_list.parent
    for suffix in (".bin", ".idx"):
        shutil.copyfile(data / f"math{suffix}", data / f"copy{suffix}")
    file_list.write_text("1 math math\n1 copy web\n")
    spec = BlendSpec(
        stages=(BlendStage(file_list, 0),),
        seq_len=8,
        num_samples=10,
        seed=1,
        cache=tmp_path / "cache",
    )
    message = error_of(build_blend, spec)
    assert message.startswith(f"{file_list}:2: ")
    assert f"is a byte-identical copy of '{data / 'math'}' on {file_list}:1" in message
