"""``goodput broadcast --compress`` over real ssh (the loopback sshd of ``.ci/start-sshd``, aliases
node1..node4): one archive read once from the source, sent host to host, unpacked once per host;
a layered venv staged so that it imports from the copy with its sources renamed away.
Elsewhere these tests skip unless that server answers (CI runs it and allows no skips).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from goodput import cli
from goodput.launch.broadcast import ORIGIN, broadcast
from goodput.launch.layers import LAYERS_DIR
from goodput.launch.transports import ARCHIVE_SUFFIX, MARKER, make_transport
from goodput.testing.sshd import SSH_CONFIG, sshd_answers
from goodput.testing.trees import file_tree
from goodput.testing.venvs import make_layered_venv

HOSTS = ["node1", "node2", "node3", "node4"]


pytestmark = pytest.mark.skipif(
    not sshd_answers(),
    reason="needs the test sshd (apt: openssh-server openssh-client rsync zstd; .ci/start-sshd)",
)


def _source(tmp_path: Path) -> Path:
    source = tmp_path / "shared" / "payload"
    (source / "lib").mkdir(parents=True)
    for i in range(20):
        (source / "lib" / f"mod{i}.py").write_text(f"VALUE = {i}\n" * 200)
    (source / "big.bin").write_bytes(os.urandom(1_000_000))
    (source / "link").symlink_to("big.bin")
    return source


def test_one_archive_goes_host_to_host_and_each_host_unpacks_it(tmp_path: Path) -> None:
    source = _source(tmp_path)
    nodes = tmp_path / "nodes"
    transport = make_transport("tar", str(nodes / "{host}" / "payload"), SSH_CONFIG, compress=True)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    tempfile.tempdir, before = str(scratch), tempfile.tempdir
    try:
        result = broadcast(source, HOSTS, transport=transport, fanout=2, progress=print)
    finally:
        tempfile.tempdir = before
    assert sorted(result.succeeded) == HOSTS and not result.failed
    assert sorted(copy.source == ORIGIN for copy in result.copies) == [False, False, True, True]
    files = [p for p in source.rglob("*") if p.is_file() and not p.is_symlink()]
    assert result.archive is not None
    assert result.archive.source_bytes_read == sum(p.stat().st_size for p in files)
    # Text compresses: the archive is smaller than what was read.
    assert result.archive.archive_bytes < result.archive.source_bytes_read
    expected = file_tree(source)
    for host in HOSTS:
        copy = nodes / host / "payload"
        assert {k: v for k, v in file_tree(copy).items() if k != MARKER} == expected
        assert json.loads((copy / MARKER).read_text())["source"] == str(source)
        assert sorted(os.listdir(nodes / host)) == ["payload"]  # no archive, no partial left
    assert not os.listdir(scratch)  # nor the origin's archive


def test_a_failed_unpack_leaves_no_partial_and_no_archive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _source(tmp_path)
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    (nodes / "node2").write_text("a file where the host's folder should be")
    dest = str(nodes / "{host}" / "payload")
    code = cli.main(["broadcast", str(source), "--compress", "--hosts", "node1,node2",
                     "--dest", dest, "--ssh-config", str(SSH_CONFIG), "--retries", "0",
                     "--min-success", "1"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0 and "failed: node2" in out and "node2 failed 1 times" in err
    assert out.startswith("broadcast: 1 of 2 hosts in ") and "source read once: " in out
    assert sorted(os.listdir(nodes / "node1")) == ["payload"]
    assert (nodes / "node2").read_text() == "a file where the host's folder should be"
    assert not list(nodes.glob(f"*{ARCHIVE_SUFFIX}"))


def test_a_layered_venv_sent_compressed_imports_from_the_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    venv, base_site, under_site = make_layered_venv(tmp_path)
    dest = tmp_path / "node-local" / "venv"
    code = cli.main(["broadcast", str(venv), "--compress", "--hosts", "node1", "--dest",
                     str(dest), "--ssh-config", str(SSH_CONFIG)])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("broadcast: 1 of 1 hosts in "), err
    assert f"staging {base_site}" in err and f"staging {under_site}" in err
    for path in (venv, under_site.parents[2], base_site):
        path.rename(path.with_name(path.name + ".away"))
    code = "import base_pkg, layered_pkg, sys; print(base_pkg.__file__, layered_pkg.__file__)"
    ssh = ["ssh", "-F", str(SSH_CONFIG), "node1", f"{dest}/bin/python -c '{code}'"]
    found = subprocess.run(ssh, capture_output=True, text=True, timeout=60, check=True).stdout
    base_file, layered_file = found.split()
    assert base_file.startswith(f"{dest}/{LAYERS_DIR}/") and base_file.endswith("__init__.py")
    assert layered_file.startswith(f"{dest}/{LAYERS_DIR}/")
    # The prefix moved too: the copy's own scripts name the copy.
    assert str(dest) in (dest / "bin" / "activate").read_text()
    assert str(venv) not in (dest / "pyvenv.cfg").read_text()
