import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from goodput.errors import ExitCode, GoodputError
from goodput.io import (
    atomic_path,
    is_complete,
    sha256_file,
    stray_temps,
    write_json,
    write_marker,
)


def test_atomic_write_leaves_old_content_on_failure(tmp_path):
    target = tmp_path / "a.json"
    write_json(target, {"v": 1})
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text().strip() == '{\n  "v": 1\n}'
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]  # no temp file left behind


def test_marker_and_checksum(tmp_path):
    assert not is_complete(tmp_path)
    write_marker(tmp_path)
    assert is_complete(tmp_path)
    (tmp_path / "x").write_bytes(b"abc")
    assert sha256_file(tmp_path / "x") == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )


def test_error_is_one_line_and_survives_pickling():
    error = GoodputError("data/a.jsonl:3", "malformed\nJSON", "fix the line", code=ExitCode.USAGE)
    assert error.render() == "data/a.jsonl:3: malformed JSON; fix the line"
    clone = pickle.loads(pickle.dumps(error))
    assert clone.render() == error.render() and clone.code == ExitCode.USAGE


@pytest.mark.timeout(20)  # the old open() blocked here until a writer came: forever
def test_readers_refuse_what_is_not_a_regular_file_without_blocking(tmp_path):
    import socket

    from goodput.io import open_regular, read_json, read_text

    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    with pytest.raises(
        GoodputError, match=r"config\.toml: is a FIFO \(named pipe\), not a regular"
    ):
        read_text(fifo)
    with pytest.raises(GoodputError, match="is a folder, not a regular file"):
        read_json(tmp_path)
    with pytest.raises(GoodputError, match="is a device, not a regular file"):
        open_regular("/dev/null")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "sock"))
    try:
        with pytest.raises(GoodputError, match="is a socket, not a regular file"):
            open_regular(tmp_path / "sock")
    finally:
        server.close()
    with pytest.raises(GoodputError, match="No such file"):
        open_regular(tmp_path / "absent")
    (tmp_path / "real").write_bytes(b"data")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with open_regular(tmp_path / "link") as f:  # a link to a regular file is that file
        assert f.read() == b"data"


def test_a_folder_listing_keeps_regular_files_and_notes_the_rest(tmp_path, capsys):
    from goodput.io import regular_files

    (tmp_path / "b.yaml").write_text("b")
    (tmp_path / "a.yaml").write_text("a")
    os.mkfifo(tmp_path / "pipe.yaml")
    (tmp_path / "sub").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    kept = regular_files(tmp_path.iterdir())
    assert [p.name for p in kept] == ["a.yaml", "b.yaml"]
    notes = capsys.readouterr().err.splitlines()
    assert sorted(n.rsplit("/", 1)[1] for n in notes) == [
        "dangling: not a regular file",
        "pipe.yaml: not a regular file",
        "sub: not a regular file",
    ]
    assert all(n.startswith("goodput: note: skipping ") for n in notes)


def test_the_json_writer_refuses_non_finite_numbers_naming_the_key():
    from goodput.io import json_text

    assert json_text({"b": [1, 2.5], "a": None}, where="x", sort_keys=True) == (
        '{"a": null, "b": [1, 2.5]}'
    )
    for bad, key in [
        ({"runs": [{"goodput": float("nan")}]}, "runs.0.goodput"),
        (float("inf"), "the top level"),
        ((1, -float("inf")), "1"),
    ]:
        with pytest.raises(GoodputError) as caught:
            json_text(bad, where="goodput report --json")
        assert caught.value.where == "goodput report --json"
        assert f"non-finite number at {key}," in caught.value.what


def test_stray_temps_are_the_temp_files_a_killed_atomic_write_leaves_and_nothing_else(tmp_path):
    """What ``atomic_path`` leaves when its process dies before the rename (mkstemp's own names,
    made here by mkstemp itself) is found; a lookalike of another length, another file's temp,
    a link or a folder by the right name are not."""
    final = tmp_path / "rank-00001.slot-0.json"
    killed = [Path(tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=tmp_path)[1])]
    killed.append(tmp_path / f".{final.name}.ab_c1234.tmp")
    for name in killed:
        name.touch()
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_text("not goodput's")
    (tmp_path / f".{final.name}.link1234.tmp").symlink_to(outside)
    (tmp_path / f".{final.name}.fold1234.tmp").mkdir()
    for lookalike in (
        f".{final.name}.abc123456.tmp",  # 9 characters: not mkstemp's
        f".{final.name}.ABCD1234.tmp",  # upper case: not mkstemp's
        ".rank-00002.slot-0.json.abcd1234.tmp",  # another file's temp
        f"{final.name}.abcd1234.tmp",  # no leading dot
        f".{final.name}.abcd1234.tmp.x",
    ):
        (tmp_path / lookalike).touch()
    assert sorted(stray_temps(final)) == sorted(killed)
    assert stray_temps(tmp_path / "absent" / "x.json") == []  # no folder: nothing stray


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_.-AZ", min_size=1, max_size=30))
@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_stray_temps_matches_exactly_mkstemps_pattern(tmp_path, name):
    folder = tmp_path / "f"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    entry = folder / name
    if name in (".", ".."):
        return
    entry.touch()
    found = stray_temps(folder / "m.json")
    expected = re.fullmatch(r"\.m\.json\.[a-z0-9_]{8}\.tmp", name) is not None
    assert found == ([entry] if expected else [])
