"""Where in-memory checkpoints live (``goodput.checkpoint.snapshot.files``): hostile files and
folders refused, names, private folders."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from goodput.checkpoint.snapshot.files import (
    SNAPSHOT_FILE,
    ensure_private_dir,
    host_folder,
    manifest_name,
    memory_root,
    own_file,
    payload_name,
    read_manifest,
    run_key,
    write_manifest,
)
from goodput.checkpoint.snapshot.format import MAX_MANIFEST_BYTES
from goodput.cli import main
from goodput.config import to_toml
from goodput.errors import GoodputError
from goodput.testing.snapshots import sample_manifest
from goodput.testing.tiny import tiny_run_config

OTHER_UID = 4242


@pytest.mark.parametrize("kind", ["symlink", "folder", "fifo", "missing", "huge", "foreign"])
def test_read_manifest_refuses_a_file_that_is_not_ours(tmp_path, kind):
    if kind == "foreign" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root (CI runs as root)")
    manifest, _ = sample_manifest()
    real = tmp_path / "real.json"
    write_manifest(real, manifest)
    path = tmp_path / manifest_name("held", 1, 0)
    if kind == "symlink":
        path.symlink_to(real)  # a valid manifest behind a link: refused
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # opened without blocking, then refused
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: refused by its size, never read
    elif kind == "foreign":
        real.rename(path)
        os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(GoodputError, match="memory snapshot file") as error:
        read_manifest(path)
    assert str(path) in str(error.value)
    if kind != "huge":  # own_file checks what a payload is before it is mapped: not its size
        with pytest.raises(GoodputError, match="memory snapshot file"):
            own_file(path)


def test_own_file_passes_our_regular_file(tmp_path):
    path = tmp_path / payload_name("own", 0, 1)
    path.write_bytes(b"\0" * 128)
    assert own_file(path).st_size == 128


def test_names_and_folders(tmp_path, monkeypatch):
    assert payload_name("own", 3, 0) == "rank-00003.slot-0.bin"
    assert manifest_name("held", 3, 1) == "held-00003.slot-1.json"
    names = [f(k, r, s) for f in (payload_name, manifest_name) for k in ("own", "held")
             for r in (0, 123456) for s in (0, 1)]  # fmt: skip
    assert all(SNAPSHOT_FILE.fullmatch(name) for name in names)
    assert not SNAPSHOT_FILE.fullmatch("rank-00003.slot-0.bin.tmp")
    for bad in (("own", 3, 2), ("own", -1, 0), ("mine", 3, 0)):
        with pytest.raises(ValueError):
            payload_name(*bad)  # type: ignore[arg-type]
    key = run_key(tmp_path / "ckpt")
    assert len(key) == 16 and int(key, 16) >= 0
    monkeypatch.chdir(tmp_path)
    assert run_key(Path("ckpt")) == key and run_key(Path("other")) != key
    folder = host_folder(tmp_path, key, "n1")
    assert folder == tmp_path / f"goodput-{os.getuid()}" / key / "n1"
    for host in ("..", "n1/../x", "", "-n1"):
        with pytest.raises(GoodputError, match="not a host name"):
            host_folder(tmp_path, key, host)
    assert memory_root(str(tmp_path)) == tmp_path
    assert memory_root(None) in (Path("/dev/shm"), Path(tempfile.gettempdir()))


def test_ensure_private_dir_makes_0700_folders_and_closes_open_ones(tmp_path):
    folder = host_folder(tmp_path, "ab" * 8, "n1")
    assert ensure_private_dir(folder) == folder
    levels = [folder.parents[1], folder.parent, folder]
    assert all(stat.S_IMODE(level.stat().st_mode) == 0o700 for level in levels)
    os.chmod(folder.parent, 0o777)
    ensure_private_dir(folder)
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize("kind", ["symlink", "file", "foreign"])
def test_ensure_private_dir_refuses_a_level_that_is_not_our_folder(tmp_path, kind):
    if kind == "foreign" and os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root (CI runs as root)")
    folder = host_folder(tmp_path, "ab" * 8, "n1")
    hostile = folder.parent  # the run's level
    hostile.parent.mkdir(mode=0o700)
    if kind == "symlink":
        (tmp_path / "elsewhere").mkdir()
        hostile.symlink_to(tmp_path / "elsewhere")
    elif kind == "file":
        hostile.write_bytes(b"")
    else:
        hostile.mkdir(mode=0o700)
        os.chown(hostile, OTHER_UID, OTHER_UID)
    with pytest.raises(GoodputError) as error:
        ensure_private_dir(folder)
    assert str(hostile) in str(error.value)
    assert not (tmp_path / "elsewhere" / "n1").exists()


def test_ensure_private_dir_names_a_memory_dir_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-folder"
    with pytest.raises(GoodputError) as error:
        ensure_private_dir(host_folder(missing, "ab" * 8, "n1"))
    assert f"{missing}: does not exist; create it, or set [checkpoint] memory_dir" in str(
        error.value
    )
    assert not missing.exists()


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda path: path.write_text("x"), "is a file, not a folder; set memory_dir to a folder"),
        (lambda path: None, "does not exist; create the folder, or leave memory_dir out"),
    ],
    ids=["a-file", "missing"],
)
def test_goodput_train_names_a_memory_dir_that_is_no_folder(tmp_path, capsys, make, says):
    """Named itself, not as the snapshot folder below it that cannot be made."""
    config = tmp_path / "run.toml"
    config.write_text(to_toml(tiny_run_config(tmp_path)))
    memory = tmp_path / "memory"
    make(memory)
    overrides = ["checkpoint.memory_interval_steps=2", f"checkpoint.memory_dir={memory}"]
    assert main(["train", str(config), *overrides]) == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(f"goodput: error: checkpoint.memory_dir {memory}: {says}"), line
    assert not (tmp_path / "memory" / f"goodput-{os.getuid()}").exists()
