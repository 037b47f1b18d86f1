"""The outside trees a virtual environment imports from, and how a staged copy carries them.

A venv is rarely self-contained: ``include-system-site-packages = true`` in its ``pyvenv.cfg``
adds the site-packages of the base interpreter named by ``home`` (a conda env, a site's module
tree: where torch usually lives), and a ``.pth`` file in its site-packages may add any folder (a
venv layered on another). A broadcast that copies only the venv leaves those imports on the
shared filesystem. ``plan_layers`` finds them and says how a staged copy imports them from its
own disk: each outside folder is copied under ``goodput-layers/`` in the copy, ``pyvenv.cfg``
gets ``include-system-site-packages = false``, each ``.pth`` line naming an outside folder is
pointed at its copy (a path relative to site-packages, so the copy may live anywhere), and the
base's site folders are listed, in ``sys.path`` order, in ``LAYERS_PTH``, processed after the
venv's own ``.pth`` files as Python processes system site folders after the venv's.

Invariants: ``pyvenv.cfg`` and ``.pth`` files are parsed strictly and bounded (size, lines,
characters), and a ``.pth`` ``import`` line is never run here; a base site folder's ``import``
lines are dropped with a note, since its files are then plain folders on ``sys.path`` (the venv's
own ``.pth`` files keep theirs, each named in a note: Python runs them at start-up, as it did
before, and what they import is not staged). A folder that
holds the venv (``/``, a project installed in editable mode around its venv) cannot be copied
into it, and a base whose site folders cannot be found cannot be staged: both are refused with
the fix. A base under ``/usr`` (the operating system's python) is on every node's own disk and
is left as it is, with a note. A staged file or ``goodput-layers/`` that a copy would reach
through a link (``lib/`` a link to a folder elsewhere) is refused, naming the link: a copy keeps
links as links, so the write would land in the link's target. What this module does not do:
copy the interpreter or its standard library (``home``; moved interpreters break on build-time
paths, so they stay where they are and a note says where), or copy anything at all
(``broadcast`` and ``archive`` do, from this plan).
Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from goodput.errors import GoodputError
from goodput.io import first_link, link_in_the_way, read_bytes

LAYERS_DIR = "goodput-layers"
# site.py processes a site folder's .pth files in sorted order; "~" sorts after every letter and
# digit, so the base's folders land after the venv's own .pth entries, as in the source.
LAYERS_PTH = "~goodput-layers.pth"
# A base under /usr is the operating system's python: part of every node's image, so local.
SYSTEM_PREFIX = Path("/usr")
MAX_CFG_BYTES = 64 << 10
MAX_PTH_BYTES = 1 << 20
MAX_PTH_LINES = 10_000
MAX_LAYERS = 64
MAX_SITE_DIRS = 16
QUERY_TIMEOUT_S = 60
CFG_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# Control characters (tab and the line breaks apart) in a value or a .pth line: never a path.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class PyvenvConfig:
    home: str | None
    system_site_packages: bool
    executable: str | None
    version: str | None


@dataclass(frozen=True, slots=True)
class PthLine:
    number: int  # from 1
    kind: str  # "path" or "import"
    text: str


@dataclass(frozen=True, slots=True)
class Layer:
    source: Path  # the outside folder, resolved
    name: str  # its folder under LAYERS_DIR in the staged copy
    why: str  # what adds it: "pyvenv.cfg include-system-site-packages" or "FILE.pth line N"


@dataclass(frozen=True, slots=True)
class VenvLayers:
    """How a staged copy of a venv imports from its own disk: copy each layer to
    ``LAYERS_DIR/name`` and write ``replaced`` (path in the venv -> new bytes) over the copy."""

    layers: tuple[Layer, ...]
    replaced: dict[str, bytes]
    notes: tuple[str, ...]


def parse_pyvenv_cfg(text: str, where: str) -> PyvenvConfig:
    """``key = value`` lines, as ``site.py`` reads them, but strictly: every other non-blank,
    non-comment line, a repeated key, a bad value of a key we use is a ``GoodputError``."""
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, equals, value = line.partition("=")
        key, value = key.strip().lower(), value.strip()
        here = f"{where}:{number}"
        if not equals or not CFG_KEY.fullmatch(key) or CONTROL.search(value):
            raise _bad(here, "is not a 'key = value' line", "fix or remove the line")
        if key in values:
            raise _bad(here, f"repeats {key!r}", "keep one line per key")
        values[key] = value
    system = values.get("include-system-site-packages", "false").lower()
    if system not in ("true", "false"):
        raise _bad(where, f"include-system-site-packages is {system!r}", "use true or false")
    for key in ("home", "executable"):
        if key in values and not os.path.isabs(values[key]):
            raise _bad(where, f"{key} {values[key]!r} is not an absolute path", "fix the path")
    return PyvenvConfig(
        home=values.get("home"),
        system_site_packages=system == "true",
        executable=values.get("executable"),
        version=values.get("version"),
    )


def parse_pth(text: str, where: str) -> list[PthLine]:
    """A ``.pth`` file's path and ``import`` lines, as ``site.addpackage`` tells them apart
    (comments and blank lines dropped); at most ``MAX_PTH_LINES`` lines, no control characters."""
    lines = text.splitlines()
    if len(lines) > MAX_PTH_LINES:
        raise _bad(where, f"has more than {MAX_PTH_LINES:,} lines", "trim the file")
    found = []
    for number, line in enumerate(lines, 1):
        if line.startswith("#") or not line.strip():
            continue
        if CONTROL.search(line):
            raise _bad(f"{where}:{number}", "holds a control character", "fix the line")
        kind = "import" if line.startswith(("import ", "import\t")) else "path"
        found.append(PthLine(number, kind, line.rstrip()))
    return found


def _bad(where: str, what: str, fix: str) -> GoodputError:
    return GoodputError.usage(where, what, fix)


def read_text_file(path: Path, max_bytes: int) -> str:
    """A small regular file as UTF-8 (a leading BOM dropped), bounded, or a ``GoodputError``."""
    data = read_bytes(path, max_bytes)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise _bad(str(path), "is not UTF-8 text", "fix or remove the file") from None


def site_packages(venv: Path) -> Path | None:
    """The venv's one ``lib/pythonX.Y/site-packages`` (None without one)."""
    found = sorted((venv / "lib").glob("python*/site-packages"))
    if len(found) > 1:
        names = ", ".join(str(path.relative_to(venv)) for path in found)
        raise _bad(str(venv), f"has {len(found)} site-packages ({names})", "keep one Python's")
    return found[0] if found and found[0].is_dir() and not found[0].is_symlink() else None


def base_site_dirs(venv: Path, where: str) -> list[Path]:
    """The base's site folders as the venv's own interpreter finds its base (``home`` in
    ``pyvenv.cfg``, resolved by Python's start-up, not by us), asked with ``-I -S``: no
    ``site``, so no ``.pth`` file anywhere is run."""
    python = venv / "bin" / "python"
    code = (
        "import json, site, sys; "
        "print(json.dumps(site.getsitepackages([sys.base_prefix, sys.base_exec_prefix])))"
    )
    try:
        done = subprocess.run(
            [str(python), "-I", "-S", "-c", code],
            capture_output=True,
            timeout=QUERY_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        dirs = json.loads(done.stdout.decode()) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, UnicodeDecodeError, ValueError):
        dirs = None
    valid = isinstance(dirs, list) and len(dirs) <= MAX_SITE_DIRS
    if not valid or not all(isinstance(d, str) and os.path.isabs(d) for d in dirs or []):
        raise _bad(
            where,
            f"include-system-site-packages is true but {python} did not report its base's "
            "site folders",
            "make home point at a working python, or recreate the venv without "
            "--system-site-packages",
        )
    return [Path(d) for d in dict.fromkeys(dirs or []) if os.path.isdir(d)]


def plan_layers(venv: Path) -> VenvLayers:
    """What a staged copy of ``venv`` needs from outside it (``VenvLayers``; no layers and
    nothing replaced when it is self-contained)."""
    venv = Path(os.path.realpath(venv))
    cfg_path = venv / "pyvenv.cfg"
    cfg_text = read_text_file(cfg_path, MAX_CFG_BYTES)
    config = parse_pyvenv_cfg(cfg_text, str(cfg_path))
    site = site_packages(venv)
    plan = _Planner(venv, site)
    if site is not None:
        for pth in sorted(site.glob("*.pth")):
            plan.venv_pth(pth)
    if config.system_site_packages:
        base_dirs = base_site_dirs(venv, str(cfg_path))
        if all(folder.is_relative_to(SYSTEM_PREFIX) for folder in base_dirs):
            if base_dirs:
                plan.notes.append(
                    f"the base's site folders are the system's ({SYSTEM_PREFIX}), on every "
                    "node's own disk: not copied"
                )
        else:
            plan.replaced["pyvenv.cfg"] = _system_site_off(cfg_text).encode()
            for folder in base_dirs:
                plan.base_site_dir(folder, f"{cfg_path.name} include-system-site-packages")
            plan.notes.append(
                f"the base interpreter at {config.home} and its standard library are not "
                "copied: they are read from there"
            )
    plan.finish()
    _check_unlinked(venv, plan)
    return VenvLayers(tuple(plan.layers.values()), plan.replaced, tuple(plan.notes))


def _check_unlinked(venv: Path, plan: _Planner) -> None:
    """Refuse, naming the link, a plan whose writes into a copy would go through a link the copy
    keeps (``lib`` a link to a folder elsewhere, ``goodput-layers`` a link): a copy holds links as
    links, so the write would land outside it, in the link's target. A replaced file that is a
    link itself is fine: the copy gets the staged file in its place."""
    for name in plan.replaced:
        link = first_link(venv, str(PurePosixPath(name).parent))
        if link is not None:
            raise link_in_the_way(link, f"the staged {name}")
    if plan.layers and (link := first_link(venv, LAYERS_DIR)) is not None:
        raise link_in_the_way(link, f"the staged {LAYERS_DIR}/")


def _system_site_off(text: str) -> str:
    lines = []
    for line in text.splitlines():
        key = line.partition("=")[0].strip().lower()
        key_line = key == "include-system-site-packages" and "=" in line
        lines.append("include-system-site-packages = false" if key_line else line)
    return "\n".join(lines) + "\n"


class _Planner:
    """The layers and replaced files found so far, for one venv."""

    def __init__(self, venv: Path, site: Path | None) -> None:
        self.venv = venv
        self.site = site
        self.layers: dict[Path, Layer] = {}
        self.replaced: dict[str, bytes] = {}
        self.notes: list[str] = []
        self.layers_pth: list[str] = []

    def venv_pth(self, pth: Path) -> None:
        """Point each of the venv's own ``.pth`` lines that names an outside folder at its copy;
        other lines are kept as they are (Python runs the ``import`` ones, as before)."""
        assert self.site is not None
        text = read_text_file(pth, MAX_PTH_BYTES)
        targets = {}
        for line in parse_pth(text, str(pth)):
            target = self._target(line, pth, self.site)
            if target is not None:
                targets[line.number] = target
        if targets:  # comments and other lines kept as they were
            lines = text.splitlines()
            out = [targets.get(number, line) for number, line in enumerate(lines, 1)]
            self.replaced[str(pth.relative_to(self.venv))] = ("\n".join(out) + "\n").encode()

    def base_site_dir(self, folder: Path, why: str) -> None:
        """A base site folder: copied whole, listed in ``LAYERS_PTH``, and its own ``.pth`` path
        lines flattened into ``LAYERS_PTH`` too (their ``import`` lines dropped with a note)."""
        entry = self._layer_entry(Path(os.path.realpath(folder)), why)
        self.layers_pth.append(entry)
        for pth in sorted(folder.glob("*.pth")):
            for line in parse_pth(read_text_file(pth, MAX_PTH_BYTES), str(pth)):
                target = self._target(line, pth, folder, base=entry)
                if target is not None:
                    self.layers_pth.append(target)

    def _target(
        self, line: PthLine, pth: Path, sitedir: Path, base: str | None = None
    ) -> str | None:
        """The staged line for ``line`` of ``pth`` in ``sitedir``, or None to keep it."""
        where = f"{pth} line {line.number}"
        if line.kind == "import":
            self.notes.append(
                f"{where}: an import line of the base, not run by the copy"
                if base is not None
                else f"{where}: an import line, kept for Python to run; what it imports is not "
                "staged"
            )
            return None
        folder = Path(os.path.realpath(os.path.join(sitedir, line.text)))
        if not folder.is_dir():
            return None  # site.py skips a missing folder too
        if folder.is_relative_to(self.venv):
            # An absolute path into the venv would name the source: make it relative.
            return os.path.relpath(folder, self.site) if os.path.isabs(line.text) else None
        if base is not None and folder.is_relative_to(os.path.realpath(sitedir)):
            return os.path.join(base, os.path.relpath(folder, os.path.realpath(sitedir)))
        return self._layer_entry(folder, where)

    def _layer_entry(self, folder: Path, why: str) -> str:
        """The ``.pth`` line (relative to the venv's site-packages) for ``folder``'s copy."""
        if self.venv.is_relative_to(folder):
            raise _bad(
                why,
                f"adds {folder}, which holds the venv, so it cannot be copied into it",
                "install that package into the venv without --editable, or remove the line",
            )
        if self.site is None:
            raise _bad(str(self.venv), "has no lib/pythonX.Y/site-packages", "recreate the venv")
        if folder not in self.layers:
            if len(self.layers) >= MAX_LAYERS:
                raise _bad(why, f"more than {MAX_LAYERS} outside folders", "merge them")
            name = f"{len(self.layers)}-{folder.name or 'root'}"
            self.layers[folder] = Layer(folder, name, why)
        copy = self.venv / LAYERS_DIR / self.layers[folder].name
        return os.path.relpath(copy, self.site)

    def finish(self) -> None:
        if self.layers_pth:
            assert self.site is not None
            # The venv's own LAYERS_PTH (a copy of a copy) is replaced, not appended to.
            name = str(PurePosixPath(self.site.relative_to(self.venv)) / LAYERS_PTH)
            self.replaced[name] = ("\n".join(dict.fromkeys(self.layers_pth)) + "\n").encode()
