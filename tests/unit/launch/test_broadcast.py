"""The greedy-tree broadcast, with real copies between folders standing in for hosts.

The local transport copies for real (no mocks): each "host" is a folder under tmp_path, and a host
that must fail has a file where its folder's parent should be. The remote transports are checked
by their argv lists here (test_broadcast_ssh.py runs them); ``simulate`` is checked against the
closed form of the tree. Hostile destinations and host lists: test_trust.py.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from pathlib import Path

import pytest

from goodput import cli
from goodput.errors import GoodputError
from goodput.launch.broadcast import ORIGIN, BroadcastResult, broadcast, read_hosts, simulate
from goodput.launch.transports import (
    GUARD,
    MARKER,
    RsyncTransport,
    TarTransport,
    fix_venv_prefix,
    make_transport,
)

HOSTS = [f"nid{i:03d}" for i in range(16)]


def _source(tmp_path: Path) -> Path:
    source = tmp_path / "shared" / "payload"
    (source / "lib" / "pkg").mkdir(parents=True)
    for i in range(20):
        (source / "lib" / "pkg" / f"mod{i}.py").write_bytes(os.urandom(2000))
    (source / "README").write_text("hello\n")
    (source / "link").symlink_to("README")
    return source


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file's bytes but the marker's, which only copies have."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.is_symlink() and path != folder / MARKER
    }


def _max_concurrency(result: BroadcastResult, source: str) -> int:
    events = []
    for copy in result.copies:
        if copy.source == source:
            events += [(copy.start_s + copy.seconds, -1), (copy.start_s, 1)]
    running = peak = 0
    for _, delta in sorted(events):
        running += delta
        peak = max(peak, running)
    return peak


def test_every_host_gets_an_identical_copy_by_a_tree(tmp_path: Path) -> None:
    source = _source(tmp_path)
    dest = str(tmp_path / "nodes" / "{host}" / "payload")
    lines: list[str] = []
    result = broadcast(
        source, HOSTS, transport=make_transport("local", dest), fanout=2, progress=lines.append
    )
    assert sorted(result.succeeded) == HOSTS and not result.failed and not lines
    expected = _tree(source)
    for host in HOSTS:
        copy = tmp_path / "nodes" / host / "payload"
        assert _tree(copy) == expected
        assert json.loads((copy / MARKER).read_text())["source"] == str(source)
        assert os.readlink(copy / "link") == "README"
        assert not list(copy.parent.glob(".*partial"))  # no temp copies left behind
    sources = {copy.source for copy in result.copies}
    assert sources - {ORIGIN}, "finished hosts must serve too (a tree, not a star)"
    for src in sources:
        assert _max_concurrency(result, src) <= 2
    assert len(result.copies) == len(HOSTS) and result.makespan_s > 0


def test_star_has_only_the_origin_serving(tmp_path: Path) -> None:
    source = _source(tmp_path)
    transport = make_transport("local", str(tmp_path / "nodes" / "{host}" / "p"))
    result = broadcast(source, HOSTS[:6], transport=transport, fanout=2, relay=False)
    assert {copy.source for copy in result.copies} == {ORIGIN}
    assert _max_concurrency(result, ORIGIN) <= 2


def test_a_failing_host_is_retried_then_reported(tmp_path: Path) -> None:
    source = _source(tmp_path)
    (tmp_path / "nodes").mkdir()
    (tmp_path / "nodes" / "bad1").write_text("a file where the host's folder should be")
    transport = make_transport("local", str(tmp_path / "nodes" / "{host}" / "payload"))
    hosts = ["good1", "bad1", "good2", "good3"]
    lines: list[str] = []
    result = broadcast(
        source, hosts, transport=transport, fanout=2, retries=2, min_success=3,
        progress=lines.append,
    )  # fmt: skip
    assert sorted(result.succeeded) == ["good1", "good2", "good3"]
    assert list(result.failed) == ["bad1"] and "Error" in result.failed["bad1"]
    assert sum("retrying" in line for line in lines) == 2
    assert any("bad1 failed 3 times" in line for line in lines)

    with pytest.raises(GoodputError, match=r"3 of 4 hosts got a copy, 4 needed; failed: bad1 \("):
        broadcast(source, hosts, transport=transport, retries=0, progress=lines.append)


def test_a_copied_venv_points_at_its_new_home(tmp_path: Path) -> None:
    venv = tmp_path / "shared" / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = true\n")
    (venv / "bin" / "activate").write_text(f'VIRTUAL_ENV="{venv}"\nexport VIRTUAL_ENV\n')
    (venv / "bin" / "activate.fish").write_text(f'set -gx VIRTUAL_ENV "{venv}"\n')
    (venv / "bin" / "tool").write_text(f"#!{venv}/bin/python\nprint('{venv}')\n")
    (venv / "bin" / "tool").chmod(0o755)
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")
    hosts = ["a", "b", "c"]
    dest = str(tmp_path / "nodes" / "{host}" / "venv")
    result = broadcast(venv, hosts, transport=make_transport("local", dest), fanout=1)
    # After the first copy the origin and "a" are both idle: "a" serves b (a copy of a copy).
    assert sorted((copy.source, copy.host) for copy in result.copies) == [
        (ORIGIN, "a"),
        (ORIGIN, "c"),
        ("a", "b"),
    ]
    for host in hosts:
        home = tmp_path / "nodes" / host / "venv"
        assert (
            home / "bin" / "activate"
        ).read_text() == f'VIRTUAL_ENV="{home}"\nexport VIRTUAL_ENV\n'
        assert (home / "bin" / "activate.fish").read_text() == f'set -gx VIRTUAL_ENV "{home}"\n'
        # Only the shebang line of a script is rewritten.
        assert (home / "bin" / "tool").read_text() == f"#!{home}/bin/python\nprint('{venv}')\n"
        assert os.access(home / "bin" / "tool", os.X_OK)
        assert os.readlink(home / "bin" / "python") == "/usr/bin/python3"
    plain = tmp_path / "plain"
    (plain / "bin").mkdir(parents=True)
    (plain / "bin" / "activate").write_text(str(venv))
    assert fix_venv_prefix(plain, old=str(venv), new="/x") == 0  # no pyvenv.cfg: not a venv


def test_simulate_tree_is_logarithmic_and_star_linear() -> None:
    tree, star = simulate(10_624, 10.0, 8)
    # Hosts done after r rounds: 9**r - 1 (origin + finished hosts, 8 slots each).
    assert tree == 10.0 * math.ceil(math.log(10_625, 9)) == 50.0
    assert tree < 8 * 10.0
    assert star == math.ceil(10_624 / 8) * 10.0
    for num_hosts in (0, 1, 7, 8, 9, 80, 81, 512, 4096):
        tree, star = simulate(num_hosts, 3.0, 8)
        assert tree <= star
        assert tree == 3.0 * (math.ceil(math.log(num_hosts + 1, 9) - 1e-9) if num_hosts else 0)
    assert simulate(5, 1.0, 1) == (3.0, 5.0)  # 1, 2, 4, 8 done after 0..3 rounds


def test_cli_simulate(capsys: pytest.CaptureFixture[str]) -> None:
    expected = ["tree: 50.0 s (10624 hosts, fanout 8)", "star: 13280.0 s", "star/tree: 265.6x"]
    args = ["broadcast", "--simulate", "--nhosts", "10624", "--copy-seconds", "10"]
    assert cli.main(args) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == expected and err == ""
    assert cli.main(["broadcast", "--simulate", "--nhosts", "10"]) == 2
    assert "needs --nhosts and --copy-seconds" in capsys.readouterr().err
    # The old spelling still works for one release, with one deprecation line.
    args = ["broadcast", "--simulate", "--nodes", "10624", "--copy-seconds", "10"]
    assert cli.main(args) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == expected
    assert err == "goodput: warning: --nodes is deprecated; use --nhosts\n"


def test_cli_local_broadcast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _source(tmp_path)
    hostfile = tmp_path / "nodefile"
    hostfile.write_text("x1\nx1\nx2  # two ranks each\n\nx3\n")
    assert read_hosts(None, hostfile) == ["x1", "x2", "x3"]
    dest = str(tmp_path / "nodes" / "{host}" / "p")
    code = cli.main(
        ["broadcast", str(source), "--hostfile", str(hostfile), "--dest", dest,
         "--transport", "local", "--fanout", "2"]
    )  # fmt: skip
    assert code == 0
    assert capsys.readouterr().out.startswith("broadcast: 3 of 3 hosts in ")
    assert _tree(tmp_path / "nodes" / "x3" / "p") == _tree(source)


@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        (["ok", "bad;rm -rf"], "not a valid host name"),
        (["ok", "-oProxyCommand=x"], "not a valid host name"),
        (["ok", "ok"], "listed twice"),
    ],
)
def test_bad_host_lists_are_rejected(tmp_path: Path, hosts: list[str], message: str) -> None:
    source = _source(tmp_path)
    transport = make_transport("local", str(tmp_path / "{host}"))
    with pytest.raises(GoodputError, match=message):
        broadcast(source, hosts, transport=transport)
    assert not (tmp_path / "ok").exists()  # nothing copied before the list was checked


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(GoodputError, match="unknown transport 'scp'; use one of local, rsync, tar"):
        make_transport("scp", "/tmp/x")
    with pytest.raises(GoodputError, match="has no {host}"):
        make_transport("local", "/tmp/x")
    with pytest.raises(GoodputError, match="--min-success"):
        broadcast(_source(tmp_path), ["a"], transport=make_transport("local", "/tmp/{host}"),
                  min_success=2)  # fmt: skip
    assert cli.main(["broadcast", "--hosts", "a", "--dest", "/tmp/x"]) == 2
    assert "needs SOURCE and --dest" in capsys.readouterr().err


def test_remote_transports_build_argv_lists(tmp_path: Path) -> None:
    origin = Path("/lus/proj/venv")
    config = tmp_path / "ssh_config"
    config.write_text("")
    ssh = ["ssh", "-F", str(config)]
    marker = '{"source": "/lus/proj/venv"}'

    def guarded(then: str, *args: str) -> list[str]:
        return ["sh", "-c", f"{GUARD}\n{then}", "sh", "/tmp/venv", "/tmp/venv.partial", *args]

    def on_n2(argv: list[str]) -> tuple[list[str], list[str]]:
        return argv[:4], shlex.split(argv[4])

    publish = guarded(
        f'rm -f -- "$2/{MARKER}" && printf "%s\\n" "$3" >"$2/{MARKER}" && rm -rf -- "$1" '
        '&& mv -- "$2" "$1"',
        marker,
    )
    rsync = RsyncTransport("/tmp/venv", config)
    options = ["-a", "--delete", "-e", f"ssh -F {config}"]
    options += ["--rsync-path", shlex.join(guarded('mkdir -p -- "$2"')) + " && rsync"]
    (push,), (last,) = rsync.commands(origin, None, "n2", marker)
    assert push == ["rsync", *options, "/lus/proj/venv/", "n2:/tmp/venv.partial/"]
    assert on_n2(last) == ([*ssh, "n2"], publish)
    # Host to host: n1 runs rsync, whose own ssh to n2 gets the config too; one quoted line.
    (push,) = rsync.commands(origin, "n1", "n2", marker)[0]
    assert push[:4] == [*ssh, "n1"]
    assert shlex.split(push[4]) == ["rsync", *options, "/tmp/venv/", "n2:/tmp/venv.partial/"]
    assert RsyncTransport("/tmp/venv").commands(origin, None, "n2", marker)[0][0][4] == "ssh"

    tar = TarTransport("/tmp/venv", config)
    unpack = guarded('rm -rf -- "$2" && mkdir -p -- "$2" && tar -C "$2" -xf -')
    (pack, receive), (last,) = tar.commands(origin, None, "n2", marker)
    assert pack == ["tar", "-C", "/lus/proj/venv", "-cf", "-", "."]
    assert on_n2(receive) == ([*ssh, "n2"], unpack)
    assert on_n2(last) == ([*ssh, "n2"], publish)
    (relay,) = tar.commands(origin, "n1", "n2", marker)[0]
    assert relay[:4] == [*ssh, "n1"]
    *bash, line = shlex.split(relay[4])
    assert bash == ["bash", "-o", "pipefail", "-c"]
    pack_line, receive_line = line.split(" | ")
    assert pack_line == "tar -C /tmp/venv -cf - ."
    receive = shlex.split(receive_line)
    assert on_n2(receive) == ([*ssh, "n2"], unpack)
