"""A venv's layers (``goodput.launch.layers``): the strict readers of ``pyvenv.cfg`` and ``.pth``
files, and real layered venvs staged by the local transport, their sources renamed away after.

The base interpreter is a real one laid out as a site's module tree is: its own prefix (``bin/``
with a link to this interpreter, ``lib/pythonX.Y/`` whose standard library entries link to this
interpreter's) and its own, small, site-packages. A venv made from it with
``--system-site-packages`` imports that site-packages, and a ``.pth`` line adds a second venv's
site-packages: both must come from the staged copy. The ssh side: test_broadcast_compress_ssh.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from goodput.errors import GoodputError
from goodput.launch.broadcast import broadcast
from goodput.launch.layers import (
    LAYERS_DIR,
    LAYERS_PTH,
    MAX_PTH_LINES,
    parse_pth,
    parse_pyvenv_cfg,
    plan_layers,
)
from goodput.launch.transports import make_transport
from goodput.testing.venvs import make_layered_venv, run


def _imports(python: Path, *names: str) -> dict[str, str]:
    code = f"import json; print(json.dumps({{n: __import__(n).__file__ for n in {names!r}}}))"
    return json.loads(run(python, "-c", code))


def test_a_layered_venv_imports_from_its_staged_copy(tmp_path: Path) -> None:
    venv, base_site, under_site = make_layered_venv(tmp_path)
    assert _imports(venv / "bin" / "python", "base_pkg", "layered_pkg") == {
        "base_pkg": str(base_site / "base_pkg" / "__init__.py"),
        "layered_pkg": str(under_site / "layered_pkg" / "__init__.py"),
    }
    lines: list[str] = []
    dest = str(tmp_path / "nodes" / "{host}" / "venv")
    broadcast(venv, ["n1", "n2"], transport=make_transport("local", dest), progress=lines.append)
    assert any(f"staging {base_site} (pyvenv.cfg include-system-site-packages)" in line
               for line in lines)  # fmt: skip
    assert any(f"staging {under_site} (" in line and "_under.pth line 2)" in line for line in lines)
    # Everything the copies were made from goes away (the base interpreter itself stays: it is
    # not copied, and a note says so).
    assert any("base interpreter" in line and "not copied" in line for line in lines)
    for path in (venv, under_site.parents[2], base_site):
        path.rename(path.with_name(path.name + ".away"))
    for host in ("n1", "n2"):
        copy = tmp_path / "nodes" / host / "venv"
        found = _imports(copy / "bin" / "python", "base_pkg", "layered_pkg")
        assert found["base_pkg"].startswith(f"{copy}/{LAYERS_DIR}/"), found
        assert found["layered_pkg"].startswith(f"{copy}/{LAYERS_DIR}/"), found
        assert "include-system-site-packages = false" in (copy / "pyvenv.cfg").read_text()
        (site,) = (copy / "lib").glob("python*/site-packages")
        # The .pth keeps its comment and import line; only the outside path moved.
        under_pth = (site / "_under.pth").read_text().splitlines()
        assert under_pth[0] == "# the base venv" and under_pth[2] == "import os"
        assert not os.path.isabs(under_pth[1]) and (site / LAYERS_PTH).is_file()


def test_a_copy_of_a_staged_copy_needs_no_layers(tmp_path: Path) -> None:
    venv, _, _ = make_layered_venv(tmp_path)
    transport = make_transport("local", str(tmp_path / "nodes" / "{host}" / "venv"))
    broadcast(venv, ["n1"], transport=transport, progress=lambda line: None)
    staged = plan_layers(tmp_path / "nodes" / "n1" / "venv")
    assert staged.layers == () and staged.replaced == {}
    assert [note.split(": ", 1)[1] for note in staged.notes] == [
        "an import line, kept for Python to run; what it imports is not staged"
    ]


def test_a_self_contained_venv_has_nothing_to_stage(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    assert plan_layers(venv).layers == () and plan_layers(venv).replaced == {}


def test_pth_import_lines_are_neverrun(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    (site,) = (venv / "lib").glob("python*/site-packages")
    witness = tmp_path / "ran"
    (site / "evil.pth").write_text(f"import pathlib; pathlib.Path({str(witness)!r}).touch()\n")
    staged = plan_layers(venv)
    assert staged.layers == () and not witness.exists()
    assert staged.notes == (f"{site / 'evil.pth'} line 1: an import line, kept for Python to run; "
                            "what it imports is not staged",)  # fmt: skip


@pytest.mark.parametrize("line", ["/", "{parent}", "../../../../.."])
def test_a_pth_folder_that_holds_the_venv_is_refused_with_the_fix(
    tmp_path: Path, line: str
) -> None:
    venv = tmp_path / "project" / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    (site,) = (venv / "lib").glob("python*/site-packages")
    (site / "__editable__.project.pth").write_text(line.replace("{parent}", str(venv.parent)))
    with pytest.raises(GoodputError, match="which holds the venv.*without --editable") as error:
        plan_layers(venv)
    assert "__editable__.project.pth line 1" in str(error.value)


def test_a_base_that_cannot_answer_is_refused(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(tmp_path / "missing" / "python3")
    (venv / "pyvenv.cfg").write_text(
        f"home = {tmp_path}/missing\ninclude-system-site-packages = true\n"
    )
    with pytest.raises(GoodputError, match="did not report its base's site folders"):
        plan_layers(venv)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("home /usr/bin\n", "is not a 'key = value' line"),
        ("home = /a\nHOME = /b\n", "repeats 'home'"),
        ("include-system-site-packages = yes\n", "include-system-site-packages is 'yes'"),
        ("home = usr/bin\n", "home 'usr/bin' is not an absolute path"),
        ("home = /usr/bin\x00x\n", "is not a 'key = value' line"),
        ("ho me = /usr/bin\n", "is not a 'key = value' line"),
        ("= /usr/bin\n", "is not a 'key = value' line"),
    ],
)
def test_hostile_pyvenv_cfg_is_refused(text: str, message: str) -> None:
    with pytest.raises(GoodputError, match=message) as error:
        parse_pyvenv_cfg(text, "v/pyvenv.cfg")
    assert "\n" not in error.value.render() and error.value.render().startswith("v/pyvenv.cfg")


def test_pyvenv_cfg_as_site_reads_it() -> None:
    text = "# made by hand\nHome = /opt/py/bin\n\ninclude-system-site-packages = TRUE\nx.y-z = 1\n"
    config = parse_pyvenv_cfg(text, "cfg")
    assert config.home == "/opt/py/bin" and config.system_site_packages


def test_pth_lines_are_told_apart_and_bounded() -> None:
    found = parse_pth("# c\n\n/a/b  \nimport os\nimport\tsys\nimportant/x\n", "x.pth")
    assert [(line.number, line.kind, line.text) for line in found] == [
        (3, "path", "/a/b"),
        (4, "import", "import os"),
        (5, "import", "import\tsys"),
        (6, "path", "important/x"),
    ]
    with pytest.raises(GoodputError, match="x.pth:2: holds a control character"):
        parse_pth("/a\n/b\x1b[2J\n", "x.pth")
    with pytest.raises(GoodputError, match=f"more than {MAX_PTH_LINES:,} lines"):
        parse_pth("/a\n" * (MAX_PTH_LINES + 1), "x.pth")


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("pyvenv.cfg", b"home = /usr/\xff\n", "is not UTF-8 text"),
        ("pyvenv.cfg", b"home = /usr/bin\n" + b"#" * (64 << 10), "is larger than"),
        ("lib/python3.11/site-packages/bad.pth", b"\xfe\xfe\n", "is not UTF-8 text"),
    ],
)
def test_hostile_venv_files_are_refused_with_one_line(
    tmp_path: Path, name: str, data: bytes, message: str
) -> None:
    venv = tmp_path / "venv"
    (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / name).write_bytes(data)
    with pytest.raises(GoodputError, match=message) as error:
        plan_layers(venv)
    assert "\n" not in error.value.render()


def test_a_pth_that_is_a_device_or_fifo_is_refused(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    os.mkfifo(site / "fifo.pth")  # a read would block forever
    (site / "zero.pth").symlink_to("/dev/zero")
    with pytest.raises(GoodputError, match="fifo.pth"):
        plan_layers(venv)
