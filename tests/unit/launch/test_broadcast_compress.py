"""``--compress`` without ssh: the argv lists of the archive transport, and the combinations that
cannot work, each refused with one line before anything is read or sent (the copies themselves:
test_broadcast_compress_ssh.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from goodput import cli
from goodput.errors import GoodputError
from goodput.launch.broadcast import broadcast
from goodput.launch.transports import ARCHIVE_SUFFIX, GUARD, MARKER, make_transport


def test_the_archive_transport_sends_the_archive_as_it_is(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("")
    ssh = ["ssh", "-F", str(config)]
    transport = make_transport("tar", "/tmp/venv", config, compress=True)
    archive = Path("/scratch/goodput-broadcast-x/venv.tar.zst")
    (send, receive), (publish,) = transport.commands(archive, None, "n2", "{}")
    assert send == ["cat", "--", str(archive)]
    assert receive[:4] == [*ssh, "n2"]
    words = shlex.split(receive[4])
    bash_c, script, name, args = words[:4], words[4], words[5], words[6:]
    assert bash_c == ["bash", "-o", "pipefail", "-c"] and name == "sh"
    assert script.startswith(GUARD) and 'tee -- "$3" | zstd -dcq | tar -C "$2" -xf -' in script
    assert args == ["/tmp/venv", "/tmp/venv.partial", f"/tmp/venv{ARCHIVE_SUFFIX}"]
    assert MARKER in publish[4]
    # Host to host: n1 sends its own copy of the archive, nothing is packed again.
    (relay,), _ = transport.commands(archive, "n1", "n2", "{}")
    assert relay[:4] == [*ssh, "n1"]
    *bash_c, line = shlex.split(relay[4])
    assert bash_c == ["bash", "-o", "pipefail", "-c"]
    send_line, receive_line = line.split(" | ", 1)
    assert shlex.split(send_line) == ["cat", "--", f"/tmp/venv{ARCHIVE_SUFFIX}"]
    assert shlex.split(receive_line) == receive


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--transport", "rsync"], "--compress: sends one tar.zst archive host to host, which "
         "the rsync transport does not; use --transport tar"),
        (["--transport", "local", "--dest", "/tmp/n/{host}/p"], "the local transport does not"),
        (["--checkpoint", "RUN"], "broadcast --checkpoint: takes no --compress"),
    ],
)  # fmt: skip
def test_combinations_that_cannot_work_are_refused_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    args = ["broadcast", "--compress", "--hosts", "a,b", *argv]
    if "--checkpoint" not in argv:
        args.insert(1, str(source))
    if "--dest" not in argv:
        args += ["--dest", str(tmp_path / "dest")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing written


def test_a_venv_with_host_in_dest_is_refused_before_the_archive(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "bin" / "activate").write_text("")
    transport = make_transport("tar", str(tmp_path / "{host}" / "v"), compress=True)
    with pytest.raises(GoodputError, match="a venv must go to one path on every host"):
        broadcast(venv, ["a", "b"], transport=transport)
