import pickle

import pytest

from goodput.errors import ExitCode, GoodputError
from goodput.io import atomic_path, is_complete, sha256_file, write_json, write_marker


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
