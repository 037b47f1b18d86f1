"""``goodput.launch.archive``: one tar.zst written in one pass over the source, unpacked here by
the real ``tar`` and ``zstd`` a host runs, and compared with the source entry by entry."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from goodput.errors import GoodputError
from goodput.launch import archive
from goodput.launch.archive import write_archive
from goodput.launch.layers import LAYERS_DIR, Layer, VenvLayers
from goodput.testing.trees import file_tree


def _unpack(archive_path: Path, into: Path) -> None:
    into.mkdir()
    line = f"zstd -dcq -- {archive_path} | tar -C {into} -xf -"
    subprocess.run(["bash", "-o", "pipefail", "-c", line], check=True, timeout=60)


def _source(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    (source / "deep" / "er").mkdir(parents=True)
    (source / "deep" / "er" / "data.bin").write_bytes(os.urandom(300_000))
    (source / "run.sh").write_text("#!/bin/sh\necho ok\n")
    (source / "run.sh").chmod(0o750)
    (source / "link").symlink_to("run.sh")
    (source / "dangling").symlink_to("/nowhere/at/all")
    os.link(source / "run.sh", source / "deep" / "hard.sh")
    return source


def test_the_archive_holds_the_source_and_counts_each_byte_once(tmp_path: Path) -> None:
    source = _source(tmp_path)
    os.mkfifo(source / "fifo")  # skipped: a read would block
    expected = {name: entry for name, entry in file_tree(source).items() if name != "fifo"}
    with socket.socket(socket.AF_UNIX) as listening:  # skipped too: tar has no such type
        listening.bind(str(source / "sock"))
        stats = write_archive(source, tmp_path / "a.tar.zst")
    _unpack(tmp_path / "a.tar.zst", tmp_path / "out")
    assert file_tree(tmp_path / "out") == expected
    # The hard link's second name carries no bytes: each file is read once.
    regular = {p.stat().st_ino: p.stat().st_size for p in source.rglob("*")
               if stat.S_ISREG(p.lstat().st_mode)}  # fmt: skip
    assert stats.source_bytes_read == sum(regular.values())
    assert stats.archive_bytes == (tmp_path / "a.tar.zst").stat().st_size > 0


def test_a_staged_venv_gets_its_layers_new_files_and_prefix(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = /usr/bin\ncommand = python -m venv {venv}\n")
    (venv / "bin" / "activate").write_text(f'VIRTUAL_ENV="{venv}"\n')
    (venv / "bin" / "tool").write_text(f"#!{venv}/bin/python\nprint('{venv}')\n")
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")
    outside = tmp_path / "outside"
    (outside / "pkg").mkdir(parents=True)
    (outside / "pkg" / "__init__.py").write_text("X = 1\n")
    staging = VenvLayers(
        layers=(Layer(outside, "0-outside", "test"),),
        replaced={"pyvenv.cfg": f"home = /usr/bin\nx = {venv}\n".encode(), "new.pth": b"x\n"},
        notes=(),
    )
    write_archive(venv, tmp_path / "v.tar.zst", staging=staging, prefix=(str(venv), "/node/v"))
    out = tmp_path / "out"
    _unpack(tmp_path / "v.tar.zst", out)
    assert (out / "pyvenv.cfg").read_text() == "home = /usr/bin\nx = /node/v\n"
    assert (out / "bin" / "activate").read_text() == 'VIRTUAL_ENV="/node/v"\n'
    assert (out / "bin" / "tool").read_text() == f"#!/node/v/bin/python\nprint('{venv}')\n"
    assert os.readlink(out / "bin" / "python") == "/usr/bin/python3"  # a link stays a link
    assert (out / LAYERS_DIR / "0-outside" / "pkg" / "__init__.py").read_text() == "X = 1\n"
    assert (out / "new.pth").read_text() == "x\n"


def test_a_failing_zstd_is_an_error_not_an_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive, "ZSTD", ["zstd", "--no-such-option"])
    with pytest.raises(RuntimeError, match="zstd exited"):
        write_archive(_source(tmp_path), tmp_path / "a.tar.zst")


def test_without_zstd_compress_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(GoodputError, match="needs the zstd command.*apt-get install zstd"):
        archive.require_zstd()


def test_a_zstd_that_dies_is_one_line_from_the_command_not_a_silent_death(tmp_path: Path) -> None:
    """The CLI restores SIGPIPE's default (so ``goodput ... | head`` ends quietly); a zstd that
    exits before reading must still end ``goodput broadcast --compress`` with its message. A real
    child process: a ``zstd`` on PATH that fails at once, fed more than a pipe holds."""
    fake = tmp_path / "bin" / "zstd"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'zstd: out of space' >&2\nexit 3\n")
    fake.chmod(0o755)
    source = tmp_path / "payload"
    source.mkdir()
    (source / "big.bin").write_bytes(os.urandom(4 << 20))
    (tmp_path / "hosts").write_text("node1\n")
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    argv = ["broadcast", str(source), "--compress", "--hostfile", str(tmp_path / "hosts")]
    done = subprocess.run(
        [sys.executable, "-m", "goodput", *argv, "--dest", str(tmp_path / "copy")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "zstd exited 3" in done.stderr and "out of space" in done.stderr
    assert not (tmp_path / "copy").exists()
