"""User-given names and destinations: refused before anything is written; file identity."""

import os

import pytest

from goodput.data.paths import check_name, check_output_dir, check_output_file, file_identity
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


def test_output_folder_shapes(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    assert check_output_dir(tmp_path / "new" / "deeper", "--output") == tmp_path / "new" / "deeper"
    for path, message in ((file, "is a file where a folder"), (file / "sub", "file is a file")):
        with pytest.raises(GoodputError, match=message) as exc:
            check_output_dir(path, "--output")
        assert exc.value.render().startswith(f"--output {path}: ")


def test_output_file_shapes(tmp_path):
    with pytest.raises(GoodputError, match="is a folder, not a file"):
        check_output_file(tmp_path, "--output")
    (tmp_path / "file").write_text("")
    with pytest.raises(GoodputError, match="is a file where a folder should be"):
        check_output_file(tmp_path / "file" / "m.model", "--output")


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
