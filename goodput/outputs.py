"""Where a command may write: the one guard every output path of every command passes before
any work (``check_output_file``, ``check_output_dir``), and the kinds of output it knows.

A path is refused, as a usage error naming the option and the path (exit 2), when:

- it cannot be written: a file where a folder should be, a folder where a file should be, a
  folder we may not write into, or something that is not a regular file (a FIFO, a device);
- links followed, it lies inside a run directory or a checkpoint (``rundir.enclosing``), unless
  it is what that run holds of its kind: the run directory itself for a run-directory output
  (``goodput train``, ``ckpt import``/``from-torch``, ``goodput submit``), a launcher's log
  beside the run's files;
- it is an existing file that is not this command's kind of output, by the kind's own cheap
  test of the file's first bytes (a marker goodput writes into every such file, a signature, a
  schema key); an empty file holds nothing to lose and may be written. An existing folder must
  be new, empty, or hold its kind's marker;
- it is one of the command's inputs, or lies inside an input folder: a file is its
  ``(st_dev, st_ino)``, so another path, a symbolic link and a hard link are caught. A file with
  more than one hard link is refused outright: its other names may be a run's files.

Standard library only (the launcher and ``goodput submit`` call it, and never import torch). It
reads, and never creates, moves or deletes anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from goodput import rundir
from goodput.errors import GoodputError, from_exception
from goodput.io import open_regular

# Written into every HTML page of goodput report, and every PNG goodput draws (its tEXt chunk
# "Software"): what makes an existing file one that goodput wrote, so that it may be replaced.
HTML_GENERATOR = '<meta name="generator" content="goodput">'
PNG_SOFTWARE = "goodput"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The "format" value of every smoke record (``diagnose/smoke_record.py`` writes and checks it).
SMOKE_FORMAT = "goodput-smoke"
HEAD_BYTES = 64 << 10  # where a kind's marker must be: matplotlib's tEXt precedes the image data
JSON_BYTES = 64 << 20  # io.SMALL_FILE_BYTES: the JSON outputs are read whole


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of output.

    ``is_ours`` tells an existing file (or non-empty folder) of this kind from any other; None
    means an existing one is never replaced. ``run_names`` are the names it may take beside a
    run's files (a direct child of a run directory). ``run_itself``: the output may be a run
    directory (in no other run or checkpoint); ``is_run``: it must be one, new, empty, or
    holding only what launch and submit put there first (``rundir.foreign_files``).
    """

    name: str
    is_ours: Callable[[Path], bool] | None = None
    run_names: Callable[[str], bool] | None = None
    run_itself: bool = False
    is_run: bool = False


def _head(path: Path, num_bytes: int = HEAD_BYTES) -> bytes:
    with open_regular(path) as f:
        return f.read(num_bytes)


def _html_page(path: Path) -> bool:
    return HTML_GENERATOR.encode() in _head(path)


def _png_image(path: Path) -> bool:
    head = _head(path)
    return head.startswith(PNG_SIGNATURE) and b"tEXtSoftware\0" + PNG_SOFTWARE.encode() in head


def _json_value(path: Path) -> object:
    try:
        return json.loads(_head(path, JSON_BYTES))
    except (ValueError, RecursionError):
        return None


def _smoke_record(path: Path) -> bool:
    value = _json_value(path)
    return isinstance(value, dict) and value.get("format") == SMOKE_FORMAT


def _eval_summary(path: Path) -> bool:
    value = _json_value(path)
    return isinstance(value, dict) and {"results", "step", "checkpoint"} <= value.keys()


def _eval_samples(path: Path) -> bool:
    first = _head(path).split(b"\n", 1)[0]
    try:
        value = json.loads(first)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and {"task", "doc_id"} <= value.keys()


def _sentencepiece_model(path: Path) -> bool:
    import sentencepiece

    try:
        sentencepiece.SentencePieceProcessor(model_proto=_head(path, JSON_BYTES))
    except (RuntimeError, OSError, ValueError, TypeError):
        return False
    return True


def _log_name(name: str) -> bool:
    return name.endswith((".log", ".out"))


def _holds(marker: str) -> Callable[[Path], bool]:
    return lambda folder: (folder / marker).is_file()


HTML_REPORT = Kind("a goodput report page", _html_page)
PNG_PLOT = Kind("a PNG plot goodput drew", _png_image)
SMOKE_RECORD = Kind("a smoke record", _smoke_record)
EVAL_SUMMARY = Kind("a goodput eval summary", _eval_summary)
EVAL_SAMPLES = Kind("goodput eval samples", _eval_samples)
TORCH_FILE = Kind("a .pt file")  # created only: an existing one is never replaced
TOKENIZER_MODEL = Kind("a SentencePiece model", _sentencepiece_model)
LAUNCH_LOG = Kind("a log (.log or .out)", lambda path: _log_name(path.name), _log_name)
RUN_DIR = Kind("a run directory", run_itself=True, is_run=True)
# Folders whose files the command names itself, each refusing what it did not write
# (tokenize: another job's dataset under the same name; the blend cache: by fingerprint).
DATA_DIR = Kind("a data folder", lambda folder: True)
NEW_DIR = Kind("a new or empty folder")
LAUNCH_DIR = Kind("a launch folder", lambda folder: True, run_itself=True)
BROADCAST_DIR = Kind("a broadcast destination")  # check_outside_runs: the transport does the rest


def folder_holding(marker: str) -> Kind:
    """A folder that is ours when it holds ``marker`` (goodput chaos's, the demo's)."""
    return Kind(f"a folder that holds {marker}", _holds(marker))


def check_output_file(path: Path, kind: Kind, option: str, inputs: Iterable[Path] = ()) -> Path:
    """``path`` if the command may write its ``kind`` of file there; else a usage error."""
    where = f"{option} {path}"
    with _as_usage(where):
        _check_writable_folder(path.parent, path, where)
        target = path.resolve()
        if target.is_dir():
            raise GoodputError.usage(where, "is a folder, not a file", "name a file to write")
        _check_not_in_run(path, target, kind, where)
        _check_not_an_input(target, inputs, where)
        if os.path.exists(target):
            _check_existing_file(target, kind, where)
    return path


def check_output_dir(path: Path, kind: Kind, option: str, inputs: Iterable[Path] = ()) -> Path:
    """``path`` if the command may write its ``kind`` of folder there; else a usage error."""
    where = f"{option} {path}"
    with _as_usage(where):
        _check_writable_folder(path, path, where)
        target = path.resolve()
        _check_not_in_run(path, target, kind, where)
        _check_not_an_input(target, inputs, where)
        if target.is_dir():
            _check_existing_dir(target, kind, where)
    return path


def check_outside_runs(path: Path, option: str) -> Path:
    """``path`` if, links followed, it lies in no run directory or checkpoint: the one rule of
    this module for a destination whose owner checks the rest (``goodput broadcast``'s
    transports: absolute, apart from the source, a copy of theirs or nothing)."""
    where = f"{option} {path}"
    with _as_usage(where):
        _check_not_in_run(path, path.resolve(), BROADCAST_DIR, where)
    return path


@contextlib.contextmanager
def _as_usage(where: str) -> Iterator[None]:
    """What the file system says about a path, as a usage error naming the option and path."""
    try:
        yield
    except OSError as exc:
        error = from_exception(exc)
        raise GoodputError.usage(f"{where}: {error.where}", error.what, error.fix) from None
    except RuntimeError:  # Path.resolve before Python 3.13, on a loop of symbolic links
        raise GoodputError.usage(where, "is a loop of symbolic links", "fix the path") from None


def _check_writable_folder(folder: Path, given: Path, where: str) -> None:
    """``folder`` (``given`` or its parent) exists as a folder we may write into, or its nearest
    existing ancestor is one."""
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p.is_symlink())
    if not _reaches_folder(existing):
        kind = "a link to nothing" if existing.is_symlink() else "a file"
        what = f"is {kind}" if existing == given else f"{existing} is {kind}"
        raise GoodputError.usage(where, f"{what} where a folder should be", "fix the path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise GoodputError.usage(
            where,
            f"permission denied: cannot write into {existing}",
            "choose a folder you can write into, or fix its permissions",
        )


def _reaches_folder(path: Path) -> bool:
    """Whether ``path`` leads to a folder; a loop of links is the ``OSError`` that
    ``_as_usage`` names (``is_dir`` would say False, and the loop be called a file)."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:  # a link to nothing
        return False


def _check_not_in_run(given: Path, target: Path, kind: Kind, where: str) -> None:
    """Neither where the link ``given`` lives nor where it leads is in a run or a checkpoint,
    unless it is what the run holds of ``kind``."""
    link = Path(os.path.abspath(given))
    for place in (link.parent.resolve() / link.name, target):
        found = rundir.enclosing(place)
        if found is None or _run_holds(found, place, kind):
            continue
        what, folder = found
        raise GoodputError.usage(
            where,
            f"lies in the {what} {folder}, which is no output of this command",
            "choose a path outside run directories and checkpoints",
        )


def _run_holds(found: tuple[str, Path], place: Path, kind: Kind) -> bool:
    what, folder = found
    if what != rundir.RUN_DIRECTORY:
        return False
    if kind.run_itself and place == folder:
        return rundir.enclosing(folder.parent) is None
    return place.parent == folder and kind.run_names is not None and kind.run_names(place.name)


def _check_not_an_input(target: Path, inputs: Iterable[Path], where: str) -> None:
    identity = _identity(target)
    for given in inputs:
        try:
            source = given.resolve()
        except (OSError, RuntimeError):  # no file, so not the output: its own reader names it
            continue
        if identity is not None and identity == _identity(source):
            what = f"is {given}"
        elif source.is_dir() and target.is_relative_to(source):
            what = f"lies in {given}"
        else:
            continue
        raise GoodputError.usage(
            where, f"{what}, which this command also reads or writes", "write it somewhere else"
        )


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return status.st_dev, status.st_ino


def _check_existing_file(target: Path, kind: Kind, where: str) -> None:
    status = os.stat(target)
    fix = "remove it first if it may go, or choose another path"
    if not stat.S_ISREG(status.st_mode):
        raise GoodputError.usage(where, "is not a regular file", fix)
    if status.st_nlink > 1:
        raise GoodputError.usage(
            where, f"has {status.st_nlink} hard links: its other names could be inputs", fix
        )
    if status.st_size == 0:
        return
    if kind.is_ours is None:
        raise GoodputError.usage(where, "exists", fix)
    if not kind.is_ours(target):
        raise GoodputError.usage(where, f"exists and is not {kind.name}", fix)


def _check_existing_dir(target: Path, kind: Kind, where: str) -> None:
    fix = "choose a new or empty folder"
    if kind.is_run:
        foreign = rundir.foreign_files(target)
        if foreign:
            raise GoodputError.usage(
                where,
                f"is not a goodput run directory (no {rundir.RUN_RECORD}) and not empty: it "
                f"holds {foreign[0]!r}"
                + (f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""),
                f"{fix}, or an existing run directory",
            )
        return
    if not any(target.iterdir()):
        return
    if kind.is_ours is None or not kind.is_ours(target):
        raise GoodputError.usage(where, f"is not empty and is not {kind.name}", fix)
