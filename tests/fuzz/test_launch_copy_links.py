"""Fuzz the copies ``goodput broadcast`` makes over link layouts: a venv whose folders and files
(``bin/``, ``bin/activate``, a script, ``pyvenv.cfg``, ``lib/``, a ``.pth`` file naming an outside
folder, ``goodput-layers/``, a copy's marker, a data folder) are each real, or a link: to a file
or folder outside the tree, inside it, through a chain of links, dangling, or a loop.

Property: nothing outside the destinations changes (every entry of the source and of the folders
its links reach, hashed before and after), and each broadcast, over the local transport (two
hosts, the second copied from the first) and the tar and archive transports (their own commands,
run by ``sh`` on this machine instead of over ssh), is a copy or one ``GoodputError`` line. A copy
names its destination, never the source, in every venv file the prefix rewrite owns, and keeps
every other link of the source as the same link.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.launch.broadcast import broadcast
from goodput.launch.layers import LAYERS_DIR
from goodput.launch.transports import (
    MARKER,
    ArchiveTransport,
    LocalTransport,
    TarTransport,
    Transport,
    is_venv,
    prefix_pattern,
)
from goodput.testing.trees import file_tree

LINKS = ["outside", "inside", "chain", "dangling", "loop"]
SITE = "lib/python3.11/site-packages"
# Folders, parents first, and the files in them; each is made as its layout says.
FOLDERS = ["bin", "lib", LAYERS_DIR, "data"]
FILES = ["pyvenv.cfg", "bin/activate", "bin/tool", f"{SITE}/x.pth", MARKER]


class _TarHere(TarTransport):
    """The tar transport, its remote commands run by ``sh`` here instead of over ssh."""

    def on(self, host: str, *argv: str) -> list[str]:
        return ["sh", "-c", shlex.join(argv)]


class _ArchiveHere(ArchiveTransport):
    def on(self, host: str, *argv: str) -> list[str]:
        return ["sh", "-c", shlex.join(argv)]


def _content(name: str, root: Path, venv: Path) -> bytes:
    texts = {
        "pyvenv.cfg": f"home = /usr/bin\nversion = 3.11\ncommand = python3 -m venv {venv}\n",
        "bin/activate": f'VIRTUAL_ENV="{venv}"\nexport VIRTUAL_ENV\n',
        "bin/tool": f"#!{venv}/bin/python\nprint('{venv}')\n",
        f"{SITE}/x.pth": f"{root}/extra\n",
        MARKER: '{"source": "/older"}\n',
    }
    return texts.get(name, "data\n").encode()


def _place(link: Path, kind: str, root: Path, data: bytes | None) -> Path | None:
    """Make ``link`` as ``kind`` says, the real thing a file of ``data`` (None: a folder).
    Returns where the real thing is (None for a dangling link or a loop)."""

    def make(path: Path) -> None:
        if data is None:
            path.mkdir(parents=True)
        else:
            path.write_bytes(data)

    tag = str(link.relative_to(root)).replace("/", "_")
    if kind == "real":
        make(link)
        return link
    if kind == "inside":  # a sibling, by a relative link
        make(link.parent / f".in-{link.name}")
        link.symlink_to(f".in-{link.name}")
        return link.parent / f".in-{link.name}"
    if kind in ("outside", "chain"):
        target = root / "outside" / tag
        make(target)
        if kind == "chain":  # a relative link to an absolute one
            (link.parent / f".chain-{link.name}").symlink_to(target)
            link.symlink_to(f".chain-{link.name}")
        else:
            link.symlink_to(target)
        return target
    link.symlink_to(root / "outside" / f"missing-{tag}" if kind == "dangling" else link.name)
    return None


def _make_tree(root: Path, layout: dict[str, str]) -> Path:
    venv = root / "src" / "venv"
    venv.mkdir(parents=True)
    (root / "outside").mkdir()
    (root / "extra" / "pkg").mkdir(parents=True)
    where = {"": venv}  # folder -> where its content really is
    for folder in FOLDERS:
        real = _place(venv / folder, layout[folder], root, None)
        if real is not None:
            where[folder] = real
    if "lib" in where:
        (where["lib"] / "python3.11" / "site-packages").mkdir(parents=True)
        where[SITE] = where["lib"] / "python3.11" / "site-packages"
    if "data" in where:
        (where["data"] / "file").write_text("data\n")
    for name in FILES:
        parent, _, base = name.rpartition("/")
        if parent in where:
            _place(where[parent] / base, layout[name], root, _content(name, root, venv))
    if "bin" in where:
        (where["bin"] / "python").symlink_to("/usr/bin/python3")
    return venv


def _untouched(root: Path) -> dict[str, object]:
    """Everything that is not a destination: the source and the folders its links reach."""
    return {name: file_tree(root / name) for name in ("src", "outside", "extra")}


def _copied_or_refused(source: Path, transport: Transport, hosts: list[str]) -> bool:
    try:
        result = broadcast(source, hosts, transport=transport, fanout=1, progress=lambda _: None)
    except GoodputError as error:
        assert "\n" not in error.render()
        # A host fails only by a refusal, never by a crash inside its copy.
        assert "GoodputError" in error.what or "got a copy" not in error.what, error.what
        return False
    assert result.succeeded == hosts
    return True


def _check_copy(source: Path, copy: Path) -> None:
    assert (copy / MARKER).is_file() and not (copy / MARKER).is_symlink()
    names_rewritten = {"pyvenv.cfg", MARKER, f"{SITE}/x.pth", f"{SITE}/~goodput-layers.pth"}
    for path in source.rglob("*"):
        name = str(path.relative_to(source))
        assert os.path.lexists(copy / name), name
        if path.is_symlink() and name not in names_rewritten:
            assert os.readlink(copy / name) == os.readlink(path), name  # the same link
    if is_venv(source):
        old = prefix_pattern(str(source))
        for name in ["pyvenv.cfg", "bin/activate", "bin/tool"]:
            if (copy / name).is_file():
                data = (copy / name).read_bytes()
                first_line = data if name != "bin/tool" else data.partition(b"\n")[0]
                assert not old.search(first_line), name


# A few parts are links, the rest real: so that many venvs pass every check and get copied.
@given(st.dictionaries(st.sampled_from([*FOLDERS, *FILES]), st.sampled_from(LINKS), max_size=2))
def test_copies_over_link_layouts_never_write_outside(links: dict[str, str]) -> None:
    layout = {name: links.get(name, "real") for name in [*FOLDERS, *FILES]}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = _make_tree(root, layout)
        before = _untouched(root)
        transports: list[tuple[Transport, list[str], str]] = [
            (LocalTransport(str(root / "nodes" / "{host}" / "venv")), ["n1", "n2"], "nodes/{}"),
            (_TarHere(str(root / "tar" / "venv")), ["n1"], "tar"),
            (_ArchiveHere(str(root / "zst" / "venv")), ["n1"], "zst"),
        ]
        for transport, hosts, dest in transports:
            if _copied_or_refused(source, transport, hosts):
                for host in hosts:
                    _check_copy(source, root / dest.format(host) / "venv")
            assert _untouched(root) == before, type(transport).__name__
