"""User-given names: refused before anything is written; file identity (destinations:
tests/unit/core/test_outputs.py)."""

import os

import pytest

from goodput.data.paths import check_name, file_identity
from goodput.errors import ExitCode, GoodputError


@pytest.mark.parametrize(
    "name",
    ["../x", "a/b", "a\\b", "..", "a..b", "", ".hidden", "-rf", "a\0b", "a b", "é", "x" * 101],
)
def test_unsafe_names_are_usage_errors_naming_the_option(name):
    with pytest.raises(GoodputError) as exc:
        check_name(name, "--name")
    assert exc.value.code == ExitCode.USAGE
    assert exc.value.render().startswith("--name: ") and "\n" not in exc.value.render()


@pytest.mark.parametrize("name", ["web", "web_v2.1", "C4-en+code", "0", "x" * 100])
def test_plain_names_pass(name):
    assert check_name(name, "--name") == name


def test_a_file_is_one_file_through_any_link(tmp_path):
    original = tmp_path / "a"
    original.write_text("x")
    os.link(original, tmp_path / "hard")
    (tmp_path / "soft").symlink_to(original)
    (tmp_path / "copy").write_text("x")
    identity = file_identity(original)
    assert file_identity(tmp_path / "hard") == file_identity(tmp_path / "soft") == identity
    assert file_identity(tmp_path / "copy") != identity
    with pytest.raises(GoodputError, match="No such file"):
        file_identity(tmp_path / "none")
