"""Real virtual environments for the broadcast tests: a base interpreter in its own prefix, as a
site's module tree holds one, and a venv layered on it and on a second venv.

The base is this machine's interpreter laid out anew: ``bin/`` with a link to it and
``lib/pythonX.Y/`` whose standard-library entries link to its own, with a site-packages of its
own that holds only what a test puts there. A venv made from it with ``--system-site-packages``
imports that site-packages (Python finds the base from ``home``), and a ``.pth`` line adds the
second venv's site-packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"
SITE_DIRS = "import json, site, sys; print(json.dumps(site.getsitepackages([sys.base_prefix])))"


def run(*argv: str | Path) -> str:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def package(site: Path, name: str) -> None:
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text(f"NAME = {name!r}\n")


def make_base(root: Path) -> Path:
    """A base interpreter in its own prefix under ``root``; its bin/pythonX.Y."""
    real = Path(os.path.realpath(sys._base_executable))  # type: ignore[attr-defined]
    stdlib = Path(sys.base_prefix) / "lib" / VERSION
    (root / "bin").mkdir(parents=True)
    (root / "bin" / VERSION).symlink_to(real)
    (root / "lib" / VERSION).mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name not in ("site-packages", "dist-packages"):
            (root / "lib" / VERSION / entry.name).symlink_to(entry)
    return root / "bin" / VERSION


def make_layered_venv(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(venv, its base's site folder holding base_pkg, a base venv's site folder holding
    layered_pkg that a .pth line in the venv adds)."""
    python = make_base(tmp_path / "shared" / "base")
    under = tmp_path / "shared" / "under"
    run(python, "-m", "venv", "--without-pip", under)
    (under_site,) = (under / "lib").glob("python*/site-packages")
    package(under_site, "layered_pkg")
    venv = tmp_path / "shared" / "venv"
    run(python, "-m", "venv", "--without-pip", "--system-site-packages", venv)
    base_site = Path(json.loads(run(venv / "bin" / "python", "-I", "-S", "-c", SITE_DIRS))[0])
    package(base_site, "base_pkg")
    (venv_site,) = (venv / "lib").glob("python*/site-packages")
    (venv_site / "_under.pth").write_text(f"# the base venv\n{under_site}\nimport os\n")
    return venv, base_site, under_site
