"""``goodput broadcast`` of a venv with links, as a user runs it (a ``python -m goodput`` process),
on the local transport and over the test sshd (rsync, tar, ``--compress``).

A link is copied as a link and goodput never writes through one. A venv file that each copy must
rewrite (its path in ``bin/activate``, a staged ``.pth``) reached through a link (``bin/`` a link
to a folder elsewhere, ``bin/activate`` a link to a file elsewhere, ``lib/`` a link) is refused
with one line naming the link and the fix, before anything is copied, and the files the link
reaches are left as they were; the fix the line gives, run as written, makes the venv copy. A link
no copy writes through (data elsewhere, ``bin/python``) is kept as the same link. The ssh tests
skip unless the test sshd answers (``.ci/start-sshd``); CI runs it and allows no skips.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from goodput.io import first_link, read_inside, write_inside
from goodput.launch.transports import MARKER, fix_venv_prefix
from goodput.testing.sshd import SSH_CONFIG, sshd_answers
from goodput.testing.trees import file_tree

needs_sshd = pytest.mark.skipif(
    not sshd_answers(),
    reason="needs the test sshd (apt: openssh-server openssh-client rsync zstd; .ci/start-sshd)",
)
SITE = "lib/python3.11/site-packages"


@pytest.fixture
def root() -> Iterator[Path]:
    """A folder with a short path: the error line, bounded, then gives its fix whole."""
    folder = Path(tempfile.mkdtemp(prefix="gp-links-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder)


# What each layout puts behind a link to root/elsewhere (another layout: nothing).
LINKED = {"bin": "bin", "activate": "bin/activate", "lib": "lib"}


def _venv(root: Path, layout: str) -> Path:
    """A venv under ``root/shared`` whose ``LINKED[layout]`` lives in ``root/elsewhere``, behind
    a link; with a link to data elsewhere (``data``) and ``bin/python`` to its interpreter."""
    venv = root / "shared" / "venv"
    elsewhere = root / "elsewhere"
    (venv / "bin").mkdir(parents=True)
    elsewhere.mkdir()
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    (venv / "bin" / "activate").write_text(f'VIRTUAL_ENV="{venv}"\nexport VIRTUAL_ENV\n')
    (venv / "bin" / "python").symlink_to(sys.executable)
    (root / "extra" / "pkg").mkdir(parents=True)
    (elsewhere / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    (elsewhere / "lib" / SITE.partition("/")[2] / "extra.pth").write_text(f"{root / 'extra'}\n")
    (venv / "data").symlink_to(root / "extra")  # a link no copy writes through
    if layout == "bin":
        (venv / "bin").rename(elsewhere / "bin")
        (venv / "bin").symlink_to(elsewhere / "bin")
    elif layout == "activate":
        (venv / "bin" / "activate").rename(elsewhere / "activate")
        (venv / "bin" / "activate").symlink_to(elsewhere / "activate")
    (venv / "lib").symlink_to(elsewhere / "lib")
    if layout != "lib":  # the others' lib is a folder of their own
        (venv / "lib").unlink()
        (elsewhere / "lib").rename(venv / "lib")
    return venv


def _goodput(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "goodput", "broadcast", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _outside(root: Path) -> dict[str, object]:
    """What no broadcast may change: the source and every folder its links reach."""
    return {name: file_tree(root / name) for name in ("shared", "elsewhere", "extra")}


def _refused_then_fixed(root: Path, layout: str, args: list[str], dests: list[Path]) -> None:
    venv = _venv(root, layout)
    link = venv / LINKED[layout]
    before = _outside(root)
    done = _goodput(str(venv), *args)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    target = os.path.realpath(link)
    assert line.startswith(f"goodput: error: {link}: is a link (to {target}), and "), line
    assert _outside(root) == before  # the source's own files still name the source
    assert not any(os.path.lexists(dest) for dest in dests)  # nothing was copied
    # The fix, run as the line writes it; the venv then copies.
    fix = re.search(r"\((rm .*?)\), then run again$", line)
    assert fix is not None, line
    subprocess.run(["sh", "-c", fix.group(1)], check=True, timeout=30)
    fixed = _outside(root)
    done = _goodput(str(venv), *args)
    assert done.returncode == 0, done.stderr
    assert _outside(root) == fixed
    assert f'VIRTUAL_ENV="{venv}"' in (venv / "bin" / "activate").read_text()
    for dest in dests:
        assert (dest / "bin" / "activate").read_text().startswith(f'VIRTUAL_ENV="{dest}"\n')
        assert os.readlink(dest / "data") == str(root / "extra")  # the same link
        assert os.readlink(dest / "bin" / "python") == sys.executable
        assert not (dest / "bin").is_symlink() and not (dest / "lib").is_symlink()


@pytest.mark.parametrize("layout", ["bin", "activate", "lib"])
def test_a_venv_behind_a_link_is_refused_locally_and_copies_once_fixed(
    root: Path, layout: str
) -> None:
    nodes = root / "nodes"
    args = ["--hosts", "n1,n2", "--fanout", "1", "--transport", "local"]
    dests = [nodes / "n1" / "venv", nodes / "n2" / "venv"]  # n2 is copied from n1
    _refused_then_fixed(root, layout, [*args, "--dest", f"{nodes}/{{host}}/venv"], dests)


@needs_sshd
@pytest.mark.parametrize(
    ("layout", "transport"),
    [("bin", "rsync"), ("activate", "tar"), ("lib", "compress"), ("bin", "compress")],
)
def test_a_venv_behind_a_link_is_refused_over_ssh_and_copies_once_fixed(
    root: Path, layout: str, transport: str
) -> None:
    dest = root / "node-local" / "venv"
    how = ["--compress"] if transport == "compress" else ["--transport", transport]
    args = ["--hosts", "node1", *how, "--ssh-config", str(SSH_CONFIG), "--dest", str(dest)]
    _refused_then_fixed(root, layout, args, [dest])


@needs_sshd
def test_a_copied_venv_keeps_its_links_over_ssh(root: Path) -> None:
    venv = _venv(root, "none")
    (venv / "bin" / "elsewhere").symlink_to(root / "elsewhere")  # a folder link in bin/
    before = _outside(root)
    dest = root / "node-local" / "venv"
    args = ["--hosts", "node1", "--transport", "tar", "--ssh-config", str(SSH_CONFIG)]
    done = _goodput(str(venv), *args, "--dest", str(dest))
    assert done.returncode == 0, done.stderr
    assert _outside(root) == before
    assert os.readlink(dest / "bin" / "elsewhere") == str(root / "elsewhere")
    assert os.readlink(dest / "data") == str(root / "extra")
    activate = f". {shlex.quote(str(dest / 'bin' / 'activate'))} && echo $VIRTUAL_ENV"
    ssh = ["ssh", "-F", str(SSH_CONFIG), "node1", shlex.join(["bash", "-c", activate])]
    assert subprocess.run(ssh, capture_output=True, text=True, timeout=30).stdout == f"{dest}\n"


def test_a_copy_is_rewritten_without_following_its_links(root: Path) -> None:
    """The copy's own rewrite, when a source changed after it was checked: a link in the copy
    (``bin/`` to a folder elsewhere, a file link, a marker that is a link) is never written
    through; a write under a linked folder is one line naming the link."""
    old, new = root / "shared" / "venv", root / "copy"
    elsewhere = root / "elsewhere"
    (elsewhere / "bin").mkdir(parents=True)
    (elsewhere / "bin" / "activate").write_text(f'VIRTUAL_ENV="{old}"\n')
    (elsewhere / "marker").write_text("someone's\n")
    new.mkdir()
    (new / "pyvenv.cfg").write_text(f"command = python -m venv {old}\n")
    (new / "bin").symlink_to(elsewhere / "bin")
    (new / MARKER).symlink_to(elsewhere / "marker")
    before = file_tree(elsewhere)
    assert fix_venv_prefix(new, old=str(old), new=str(new)) == 1  # pyvenv.cfg only
    assert (new / "pyvenv.cfg").read_text() == f"command = python -m venv {new}\n"
    assert read_inside(new, "bin/activate") is None  # behind a link: not the copy's own
    write_inside(new, MARKER, b"{}\n")
    assert (new / MARKER).read_bytes() == b"{}\n" and not (new / MARKER).is_symlink()
    with pytest.raises(Exception, match=r"/copy/bin: is a link \(to .*/elsewhere/bin\)"):
        write_inside(new, "bin/activate", b"x")
    assert first_link(new, "bin/activate") == new / "bin"
    assert file_tree(elsewhere) == before
