"""Fuzz the readers of a venv's ``pyvenv.cfg`` and ``.pth`` files (``goodput.launch.layers``), and
``plan_layers`` over a venv whose files hold the fuzzed text.

Property: a valid result or a one-line ``GoodputError``; never another exception, and never a
``.pth`` ``import`` line run (each one here would create a witness file). Inputs come three
ways: lines built from the parts these files use (keys, ``=``, paths, ``import``), any text, and
any bytes on disk.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.launch.layers import parse_pth, parse_pyvenv_cfg, plan_layers

KEYS = st.sampled_from(["home", "include-system-site-packages", "version", "Home", "x y", ""])
VALUES = st.sampled_from(["/usr/bin", "true", "false", "TRUE", "yes", "rel/path", "", "3.11"])
CFG_LINES = st.one_of(
    st.builds(lambda k, sep, v: f"{k}{sep}{v}", KEYS, st.sampled_from([" = ", "=", " "]), VALUES),
    st.sampled_from(["# comment", "", "   ", "=", "\x00", "\ufeffhome = /x"]),
    st.text(max_size=40),
)
PTH_LINES = st.one_of(
    st.sampled_from(["import os", "import\tsys", "#x", "", "/", "..", "../../..", "/nowhere"]),
    st.text(alphabet="/.a-_\t\x00\x1b", max_size=20),
    st.text(max_size=40),
)


def _valid_or_refused(read, *args):
    try:
        return read(*args)
    except GoodputError as error:
        assert "\n" not in error.render()
        return None


@given(st.lists(CFG_LINES, max_size=12))
def test_pyvenv_cfg_lines(lines: list[str]) -> None:
    config = _valid_or_refused(parse_pyvenv_cfg, "\n".join(lines), "pyvenv.cfg")
    if config is not None and config.home is not None:
        assert os.path.isabs(config.home)


@given(st.text(max_size=300))
def test_pyvenv_cfg_any_text(text: str) -> None:
    _valid_or_refused(parse_pyvenv_cfg, text, "pyvenv.cfg")


@given(st.lists(PTH_LINES, max_size=12))
def test_pth_lines(lines: list[str]) -> None:
    found = _valid_or_refused(parse_pth, "\n".join(lines), "x.pth")
    for line in found or []:
        assert line.kind in ("path", "import") and line.text.strip()
        assert (line.kind == "import") == line.text.startswith(("import ", "import\t"))


@given(st.binary(max_size=200), st.lists(PTH_LINES, max_size=6))
def test_plan_layers_over_fuzzed_files(cfg: bytes, pth_lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        site = venv / "lib" / "python3.11" / "site-packages"
        site.mkdir(parents=True)
        (venv / "pyvenv.cfg").write_bytes(cfg)
        witness = Path(tmp) / "ran"
        run_me = f"import pathlib; pathlib.Path({str(witness)!r}).touch()"
        (site / "x.pth").write_text("\n".join([*pth_lines, run_me]), errors="surrogateescape")
        staged = _valid_or_refused(plan_layers, venv)
        assert not witness.exists()
        for layer in staged.layers if staged is not None else ():
            assert not venv.resolve().is_relative_to(layer.source)
