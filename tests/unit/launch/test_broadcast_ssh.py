"""``goodput broadcast`` over real ssh: rsync and tar between the aliases of a loopback sshd.

CI starts the server with ``.ci/start-sshd``; its ``ssh_config`` names node1..node4, each this
machine as root, so a copy one host serves another (ssh to the source host, which runs ssh to the
destination) really runs both hops. ``--dest`` holds ``{host}`` so each alias lands in its own
folder. Elsewhere these tests skip unless that server answers.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from goodput import cli
from goodput.launch.broadcast import ORIGIN, broadcast
from goodput.launch.transports import MARKER, make_transport
from goodput.testing.sshd import SSH_CONFIG, sshd_answers
from goodput.testing.trees import file_tree

HOSTS = ["node1", "node2", "node3", "node4"]


pytestmark = pytest.mark.skipif(
    not sshd_answers(),
    reason="needs the test sshd (apt: openssh-server openssh-client rsync; .ci/start-sshd)",
)


def _on_node1(*argv: str) -> str:
    ssh = ["ssh", "-F", str(SSH_CONFIG), "node1", shlex.join(argv)]
    return subprocess.run(ssh, capture_output=True, text=True, check=True, timeout=30).stdout


def _source(tmp_path: Path) -> Path:
    source = tmp_path / "shared" / "payload"
    (source / "lib" / "pkg").mkdir(parents=True)
    for i in range(30):
        (source / "lib" / "pkg" / f"mod{i}.py").write_bytes(os.urandom(3000))
    (source / "big.bin").write_bytes(os.urandom(2_000_000))
    (source / "run.sh").write_text("#!/bin/sh\necho ok\n")
    (source / "run.sh").chmod(0o750)
    (source / "link").symlink_to("run.sh")
    return source


@pytest.mark.parametrize("kind", ["rsync", "tar"])
def test_a_tree_over_ssh_lands_identical_copies(tmp_path: Path, kind: str) -> None:
    source = _source(tmp_path)
    nodes = tmp_path / "nodes"
    # A copy left by an earlier broadcast, and a half copy of a failed one, on node3.
    (nodes / "node3" / "payload").mkdir(parents=True)
    (nodes / "node3" / "payload" / "stale").write_text("from an older copy")
    (nodes / "node3" / "payload" / MARKER).write_text('{"source": "/older"}\n')
    (nodes / "node3" / "payload.partial").mkdir()
    (nodes / "node3" / "payload.partial" / "junk").write_text("half")
    transport = make_transport(kind, str(nodes / "{host}" / "payload"), SSH_CONFIG)
    lines: list[str] = []
    result = broadcast(source, HOSTS, transport=transport, fanout=2, progress=lines.append)
    assert sorted(result.succeeded) == HOSTS and not result.failed and not lines
    # fanout 2: the origin serves two hosts, which then serve the other two (host to host).
    assert sorted(copy.source == ORIGIN for copy in result.copies) == [False, False, True, True]
    expected = file_tree(source, skip={MARKER})
    for host in HOSTS:
        assert file_tree(nodes / host / "payload", skip={MARKER}) == expected, host
        assert sorted(os.listdir(nodes / host)) == ["payload"]  # no partial left behind
        marker = json.loads((nodes / host / "payload" / MARKER).read_text())
        assert marker["source"] == str(source)


@pytest.mark.parametrize("kind", ["rsync", "tar"])
def test_a_venv_sent_over_ssh_runs_at_its_destination(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    venv = tmp_path / "shared" / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    # What pip writes for a console script: a shebang naming this venv's python.
    tool = venv / "bin" / "where"
    tool.write_text(f"#!{venv}/bin/python\nimport sys\nprint(sys.prefix)\n")
    tool.chmod(0o755)
    source_tree = file_tree(venv, skip={MARKER})
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    dest = tmp_path / "node-local" / "venv"
    args = ["broadcast", str(venv), "--hosts", "node1", "--dest", str(dest)]
    assert cli.main([*args, "--transport", kind, "--ssh-config", str(SSH_CONFIG)]) == 0
    assert capsys.readouterr().out.startswith("broadcast: 1 of 1 hosts in ")

    prefix = "import sys; print(sys.prefix)"
    assert _on_node1(f"{dest}/bin/python", "-c", prefix) == f"{dest}\n"
    assert _on_node1(f"{dest}/bin/where") == f"{dest}\n"  # not the source's python
    activate = f". {shlex.quote(f'{dest}/bin/activate')} && echo $VIRTUAL_ENV"
    assert _on_node1("bash", "-c", activate) == f"{dest}\n"
    config = (dest / "pyvenv.cfg").read_text()
    assert str(venv) not in config and f"--without-pip {dest}\n" in config  # its command line
    assert file_tree(venv, skip={MARKER}) == source_tree  # the source is left as it was
    assert not os.listdir(scratch)  # and the prepared copy is gone


def test_a_host_that_cannot_connect_is_retried_and_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Include {SSH_CONFIG}\n"
        f"Host dead\n  HostName 127.0.0.1\n  Port {closed_port}\n  BatchMode yes\n"
    )
    source = _source(tmp_path)
    dest = str(tmp_path / "nodes" / "{host}" / "payload")
    common = ["broadcast", str(source), "--dest", dest, "--ssh-config", str(config)]
    hosts = ",".join([*HOSTS, "dead"])
    code = cli.main([*common, "--hosts", hosts, "--fanout", "2", "--retries", "1",
                     "--min-success", "4"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("broadcast: 4 of 5 hosts in ") and "failed: dead" in out
    retried, reported = err.splitlines()
    assert retried.startswith("broadcast: dead from ") and retried.endswith("; retrying")
    assert reported.startswith("broadcast: dead failed 2 times: RuntimeError: ")
    assert "Connection refused" in retried and "Connection refused" in reported
    assert file_tree(tmp_path / "nodes" / "node4" / "payload", skip={MARKER}) == file_tree(
        source, skip={MARKER}
    )
    assert not (tmp_path / "nodes" / "dead").exists()

    # Below --min-success (all hosts, by default): exit 1 and one line naming the host.
    assert cli.main([*common, "--hosts", "dead", "--retries", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "goodput: error: broadcast: 0 of 1 hosts got a copy" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hosts", "node1,node2;touch x"], "--hosts: 'node2;touch x' is not a valid host name"),
        (["--hosts", "node1,-oProxyCommand=x"], "'-oProxyCommand=x' is not a valid host name"),
        (["--dest", "{root}/a b/payload"], "/a b/payload' is not a safe absolute path"),
        (["--dest", "{root}/$(id)/{host}"], "/$(id)/{host}' is not a safe absolute path"),
        (["--dest", "{root}/../etc"], "is not a safe absolute path"),
        (["--dest", "/"], "'/' is not a safe absolute path"),
        (["--dest", "payload"], "'payload' is not a safe absolute path"),
        (["--ssh-config", "{root}/missing"], "/missing is not a file"),
        (["--transport", "local"], "--ssh-config: the local transport runs no ssh"),
        (["--venv"], "--dest: a venv must go to one path on every host, not 2"),
    ],
)
def test_unsafe_input_is_refused_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    source = _source(tmp_path)
    if args == ["--venv"]:  # its hosts would each need their own prefix
        (source / "pyvenv.cfg").write_text("home = /usr/bin\n")
        (source / "bin").mkdir()
        (source / "bin" / "activate").write_text("")
        args = []
    options = {
        "--hosts": "node1,node2",
        "--dest": str(tmp_path / "nodes" / "{host}" / "payload"),
        "--ssh-config": str(SSH_CONFIG),
    }
    options.update(zip(args[::2], args[1::2], strict=True))
    argv = ["broadcast", str(source)]
    for option, value in options.items():
        argv += [option, value.replace("{root}", str(tmp_path))]
    assert cli.main(argv) in (1, 2)
    err = capsys.readouterr().err
    assert err.startswith("goodput: error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "nodes").exists()  # refused before anything ran


# --- destinations goodput may not write or delete --------------------------------------------


def _sentinel(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "keep.txt").write_text("mine\n")
    return folder


def _broadcast(source: Path, kind: str, dest: str, hosts: str = "node1") -> int:
    options = ["--dest", dest, "--ssh-config", str(SSH_CONFIG), "--retries", "1"]
    return cli.main(["broadcast", str(source), "--transport", kind, "--hosts", hosts, *options])


def _last_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n"), err
    return err.splitlines()[-1]


@pytest.mark.parametrize("kind", ["rsync", "tar"])
@pytest.mark.parametrize(
    "dest", ["nodes/{host}/payload", "{root}/nodes/{host}/../../victim", "{root}/nodes/.."]
)
def test_a_dest_outside_its_folder_is_refused_before_any_ssh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    kind: str, dest: str,
) -> None:  # fmt: skip
    source = _source(tmp_path)
    monkeypatch.chdir(_sentinel(tmp_path / "work"))
    victim = _sentinel(tmp_path / "victim")
    before = file_tree(tmp_path, skip={MARKER})
    assert _broadcast(source, kind, dest.replace("{root}", str(tmp_path))) == 2
    assert "is not a safe absolute path" in _last_line(capsys)
    assert (
        file_tree(tmp_path, skip={MARKER}) == before
        and (victim / "keep.txt").read_text() == "mine\n"
    )


@pytest.mark.parametrize("kind", ["rsync", "tar"])
def test_someones_folder_at_the_destination_survives_over_ssh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    source = _source(tmp_path)
    theirs = _sentinel(tmp_path / "nodes" / "node1" / "payload")
    marked = _sentinel(tmp_path / "elsewhere")
    (marked / MARKER).write_text("{}\n")  # a marked folder reached by a link is not ours either
    (tmp_path / "nodes" / "node2").mkdir()
    (tmp_path / "nodes" / "node2" / "payload").symlink_to(marked)
    before = file_tree(tmp_path, skip={MARKER})
    dest = str(tmp_path / "nodes" / "{host}" / "payload")
    assert _broadcast(source, kind, dest, "node1,node2") == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "retrying" not in err  # a refusal is not retried
    for host in ("node1", "node2"):
        assert f"{host}:{tmp_path}/nodes/{host}/payload: exists and is not a copy goodput" in err
    assert file_tree(tmp_path, skip={MARKER}) == before  # no partial copy left either
    assert (theirs / "keep.txt").read_text() == "mine\n"


def test_a_linked_partial_copy_cannot_steer_rsync_delete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _source(tmp_path)
    victim = _sentinel(tmp_path / "victim")
    (tmp_path / "nodes" / "node1").mkdir(parents=True)
    (tmp_path / "nodes" / "node1" / "payload.partial").symlink_to(victim)  # planted by another
    assert _broadcast(source, "rsync", str(tmp_path / "nodes" / "{host}" / "payload")) == 0
    assert (victim / "keep.txt").read_text() == "mine\n" and sorted(os.listdir(victim)) == [
        "keep.txt"
    ]
    assert file_tree(tmp_path / "nodes" / "node1" / "payload", skip={MARKER}) == file_tree(
        source, skip={MARKER}
    )
    capsys.readouterr()


@pytest.mark.parametrize("kind", ["rsync", "tar"])
def test_a_node_local_copy_into_the_runs_checkpoints_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in (4, 8):
        step_dir = _sentinel(checkpoints / f"step-{step:08d}")
        (step_dir / "checksums.json").write_text("{}\n")
        (step_dir / ".complete").touch()
    before = file_tree(tmp_path, skip={MARKER})
    code = cli.main(["broadcast", "--checkpoint", str(tmp_path / "run"), "--transport", kind,
                     "--hosts", "node1", "--dest", str(checkpoints),
                     "--ssh-config", str(SSH_CONFIG)])  # fmt: skip
    assert code == 2 and "is the run's checkpoint folder" in _last_line(capsys)
    assert file_tree(tmp_path, skip={MARKER}) == before
