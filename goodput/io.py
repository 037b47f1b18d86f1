"""Atomic file writes, completion markers, checksums, and strict reads of small files.

Invariant: a file that others read appears under its final name only when complete. Writers go
through a temp name in the same directory, fsync, then ``os.replace``; directories that carry a
marker count only once the marker exists, and the marker is always written last.
``read_text`` and ``read_json`` are the one way to read a small text file from outside (configs,
host files, manifests, checkpoint metadata): bounded in size, strict UTF-8, and every way it can
be broken is a ``GoodputError`` naming the file. ``write_inside`` and ``read_inside`` write and
read a file of a tree (a copy goodput just made) without following a link on the way, so what
they touch lies inside it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, TextIO

from goodput.errors import DEBUG_HINT, GoodputError, from_exception

CHUNK_BYTES = 8 << 20
SMALL_FILE_BYTES = 64 << 20  # configs, manifests, host files, checkpoint JSON: far below this
MAX_LINES = 100_000_000  # lines of one file read line by line: far past any run's steps
SKIP_BYTES = 1 << 20  # what is read at a time of an over-long line being passed over


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates files 0600; outputs others read (shards, manifests) get the usual mode.
FILE_MODE = 0o666 & ~_current_umask()
DIR_MODE = 0o777 & ~_current_umask()  # for folders made by mkdtemp (0700) and renamed


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success fsync it and rename it onto ``path``.

    On any exception the temp file is removed and ``path`` is left as it was.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def stray_temps(path: str | os.PathLike[str]) -> list[Path]:
    """The temp files ``atomic_path`` left beside ``path`` when its process was killed before the
    rename (mkstemp's exact name: ``.NAME.`` + 8 of its characters + ``.tmp``): regular files
    only, so the name proves goodput wrote them."""
    final = Path(path)
    name = re.compile(re.escape(f".{final.name}.") + "[a-z0-9_]{8}" + re.escape(".tmp"))
    try:
        entries = list(os.scandir(final.parent))
    except OSError:
        return []
    return [
        final.parent / entry.name
        for entry in entries
        if name.fullmatch(entry.name) and entry.is_file(follow_symlinks=False)
    ]


def fsync_dir(directory: Path) -> None:
    """Make a rename durable: POSIX needs the directory entry itself flushed."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    write_text(path, json_text(obj, where=path, indent=2, sort_keys=True) + "\n")


def first_link(root: Path, relative: str) -> Path | None:
    """The first of ``relative``'s parts below ``root`` (its last part included) that is a
    symbolic link, as a path under ``root``; None when none is (a missing part ends the search:
    what is not there is no link)."""
    path = root
    for part in PurePosixPath(relative).parts:
        path = path / part
        if path.is_symlink():
            return path
        if not path.exists():
            return None
    return None


def link_in_the_way(link: Path, writes: str) -> GoodputError:
    """The refusal of a write of ``writes`` that would go through ``link``: goodput never writes
    through a link, so the fix is a real folder or file where the link is (none for a link that
    leads nowhere: a write through it would create its target)."""
    target = os.path.realpath(link)
    fix = f"replace the link with a copy of what it points to (rm {link} && cp -a {target} {link})"
    if not os.path.exists(link):
        fix = f"remove the link, which leads nowhere (rm {link})"
    return GoodputError.usage(
        link,
        f"is a link (to {target}), and {writes} would be written through it",
        f"{fix}, then run again",
    )


@contextlib.contextmanager
def _folder_inside(root: Path, parts: tuple[str, ...]) -> Iterator[int]:
    """A descriptor of the folder ``root``/``parts``, each part opened without following a link,
    so that nothing done relative to it can land outside ``root``; a link or non-folder on the
    way is ``link_in_the_way`` (the caller's own ``root`` is taken as it is)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for number, part in enumerate(parts):
            assert part not in ("", ".", ".."), parts  # relative paths of a tree's own names
            try:
                inner = os.open(
                    part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
            except OSError as exc:
                path = root.joinpath(*parts[: number + 1])
                if exc.errno in (errno.ELOOP, errno.ENOTDIR) and path.is_symlink():
                    raise link_in_the_way(path, str(root.joinpath(*parts))) from None
                raise from_exception(exc) from None
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def read_inside(root: Path, relative: str) -> tuple[bytes, int] | None:
    """The bytes and permission bits of the regular file ``root/relative``, its folders and
    itself opened without following a link (so what is read is the tree's own file); None when
    one of them is a link, a folder cannot be opened or the file is not a regular file.
    Unbounded: for a copy goodput just made."""
    *folders, name = PurePosixPath(relative).parts
    try:
        with _folder_inside(root, tuple(folders)) as folder:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(name, flags, dir_fd=folder)
    except GoodputError:
        return None  # a link among the folders, or one that cannot be opened
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link; a socket
            return None
        raise from_exception(exc) from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        return file.read(), stat.S_IMODE(info.st_mode)


def write_inside(root: Path, relative: str, data: bytes, mode: int = FILE_MODE) -> None:
    """Write ``data`` to ``root/relative`` as ``atomic_path`` does (a temp file beside it, fsync,
    rename), with every folder on the way opened without following a link: a link at the name
    itself is replaced, never written through; a link among the folders is a ``GoodputError``
    naming it. For writes into a copy, which must land inside it."""
    *folders, name = PurePosixPath(relative).parts
    with _folder_inside(root, tuple(folders)) as folder:
        tmp = f".{name}.{os.urandom(4).hex()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=folder)
        except OSError as exc:
            raise from_exception(exc) from None
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fchmod(fd, mode)
                os.fsync(fd)
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            os.fsync(folder)
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=folder)
            if isinstance(exc, OSError):
                raise from_exception(exc) from None
            raise


def json_text(
    value: Any,
    *,
    where: object,
    indent: int | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = True,
) -> str:
    """``value`` as strict JSON: the one writer of every ``--json`` and every run file.

    Python's ``json`` writes ``NaN`` and ``Infinity``, which JSON does not have and other
    readers (``jq``, JavaScript, Go) refuse. A non-finite number here is a result out of its
    domain that its producer should have turned into ``null`` with a reason or an error naming
    the input, so it is refused, naming ``where`` (the command or file) and the key.
    """
    try:
        return json.dumps(
            value, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii, allow_nan=False
        )
    except ValueError:
        key = _first_non_finite(value, "") or "a value"
        raise GoodputError(
            where,
            f"would write the non-finite number at {key}, which JSON cannot hold",
            DEBUG_HINT,
        ) from None


def print_json(value: Any, *, where: object, indent: int | None = None) -> None:
    """Print ``value`` as one strict JSON document (see ``json_text``) on stdout."""
    print(json_text(value, where=where, indent=indent), flush=True)


def _first_non_finite(value: Any, path: str) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return path or "the top level"
    items: Any = value.items() if isinstance(value, dict) else ()
    if isinstance(value, (list, tuple)):
        items = enumerate(value)
    for key, item in items:
        found = _first_non_finite(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def write_marker(directory: str | os.PathLike[str], name: str = ".complete") -> Path:
    """Write the completion marker of ``directory``. Call it last."""
    marker = Path(directory) / name
    write_text(marker, "")
    return marker


def is_complete(directory: str | os.PathLike[str], name: str = ".complete") -> bool:
    return (Path(directory) / name).is_file()


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hash of a JSON-serialisable value, independent of dict order."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for binary reading, only if it is a regular file.

    A FIFO would block ``open`` until a writer comes (forever), and a device or socket is no
    file of data: the open never blocks (``O_NONBLOCK``), and anything but a regular file is a
    ``GoodputError`` naming the path. Every reader of outside files opens through here.
    """
    require_regular(path)  # names a socket, which cannot even be opened
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise from_exception(exc) from None
    try:
        _check_regular(path, os.fstat(fd).st_mode)  # what was opened, not only what was named
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class NotOwnFile(Exception):
    """Why a path is not a regular file of this user (``reason``: one phrase, e.g. ``is a
    symbolic link``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def open_own_file(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """``path`` opened read-only, if it is a regular file of this user: its descriptor (the
    caller closes it) and its ``fstat``; ``NotOwnFile`` otherwise. For the files other
    processes of this user leave in a private folder (a beacon, a stack dump, a memory
    snapshot's manifest): a link is never followed, a FIFO never blocks the open, and what was
    opened is what is checked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotOwnFile("is missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotOwnFile("is a symbolic link") from None
        raise NotOwnFile(f"cannot be opened ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    reason = None
    if not stat.S_ISREG(info.st_mode):
        reason = "is not a regular file"
    elif info.st_uid != os.getuid():
        reason = f"is owned by uid {info.st_uid}, not this user ({os.getuid()})"
    if reason is not None:
        os.close(fd)
        raise NotOwnFile(reason)
    return fd, info


def require_regular(path: str | os.PathLike[str]) -> Path:
    """``path``, if it is a regular file (a link is followed); a ``GoodputError`` otherwise.

    For a path handed to a library that opens it itself (a tokenizer model, a Parquet file,
    ``np.load``): ``stat`` never blocks, so a FIFO is refused before the library's ``open``
    would wait for a writer forever.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise from_exception(exc) from None
    _check_regular(path, mode)
    return Path(path)


def path_status(path: str | os.PathLike[str]) -> os.stat_result | None:
    """What ``path`` reaches, links followed; None when nothing is there (no such entry, a
    dangling link, a file where a folder of the path should be).

    ``Path.exists`` and ``is_dir`` answer False for a loop of symbolic links, so an input given
    as one would be named as missing, or reach code that assumed it exists: here a loop, a
    folder of the path we may not enter or a name too long is a ``GoodputError`` naming the
    path. Where an input is first looked at, look through here.
    """
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise from_exception(exc) from None


def is_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` reaches a folder (``path_status``: a loop of links is an error)."""
    status = path_status(path)
    return status is not None and stat.S_ISDIR(status.st_mode)


def resolved(path: str | os.PathLike[str]) -> Path:
    """``path`` absolute with every link followed (``Path.resolve``), or a ``GoodputError``
    naming it: Python 3.11 raises ``RuntimeError`` for a loop of symbolic links, later ones an
    ``OSError``; either is the same line as ``path_status``'s."""
    try:
        return Path(path).resolve()
    except RuntimeError:
        loop = OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
        raise from_exception(loop) from None
    except OSError as exc:
        raise from_exception(exc) from None


def _check_regular(path: str | os.PathLike[str], mode: int) -> None:
    if not stat.S_ISREG(mode):
        what = "a folder" if stat.S_ISDIR(mode) else f"a {_special_kind(mode)}"
        raise GoodputError(path, f"is {what}, not a regular file", "pass a regular file")


def append_fd(path: str | os.PathLike[str]) -> int:
    """A descriptor appending to ``path`` (created if absent), only if it is a regular file.

    The run files goodput appends to (``metrics.jsonl``, ``evals.jsonl``, ``attempts.jsonl``)
    are opened here: opening a FIFO for writing blocks until a reader comes, so the open never
    blocks (``O_NONBLOCK``, which a FIFO without a reader answers with ``ENXIO``) and anything
    but a regular file is a ``GoodputError`` naming the path.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO (or a device) that nobody reads
            require_regular(path)
        raise from_exception(exc) from None
    try:
        _check_regular(path, os.fstat(fd).st_mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_append(path: str | os.PathLike[str]) -> TextIO:
    """``path`` opened to append UTF-8 text, only if it is a regular file (``append_fd``)."""
    return os.fdopen(append_fd(path), "a", encoding="utf-8")


def _special_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


def regular_files(paths: Iterator[Path] | list[Path]) -> list[Path]:
    """The regular files among ``paths`` (a folder's listing), sorted; anything else (a FIFO, a
    socket, a device, a folder, a dangling link) is skipped with a note on stderr, so listing a
    folder never hands a reader something that blocks or is not data."""
    kept = []
    for path in sorted(paths):
        if path.is_file():
            kept.append(path)
        else:
            print(f"goodput: note: skipping {path}: not a regular file", file=sys.stderr)
    return kept


def special_entries(folder: str, names: list[str]) -> set[str]:
    """``shutil.copytree``'s ``ignore``: the entries of ``folder`` that are neither a regular
    file, a folder nor a symbolic link (a FIFO, a socket, a device), each skipped with a note:
    copying one would fail after the rest was copied (a FIFO) or read a device forever."""
    skipped = set()
    for name in names:
        path = os.path.join(folder, name)
        with contextlib.suppress(FileNotFoundError):  # gone since it was listed: nothing to copy
            mode = os.lstat(path).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                print(f"goodput: note: skipping {path}: not a regular file", file=sys.stderr)
                skipped.add(name)
    return skipped


def read_bytes(path: str | os.PathLike[str], max_bytes: int = SMALL_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``; larger, unreadable or not a
    regular file: a ``GoodputError``."""
    try:
        with open_regular(path) as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise from_exception(exc) from None
    if len(data) > max_bytes:
        raise GoodputError(
            path, f"is larger than {max_bytes:,} bytes", "pass the right file; this one is too big"
        )
    return data


def read_text(path: str | os.PathLike[str], max_bytes: int = SMALL_FILE_BYTES) -> str:
    """The text of a small UTF-8 file; larger, unreadable or not UTF-8 is a ``GoodputError``."""
    data = read_bytes(path, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GoodputError(
            path, f"is not valid UTF-8 text (byte {exc.start})", "save it as UTF-8"
        ) from None


def read_json(path: str | os.PathLike[str], max_bytes: int = SMALL_FILE_BYTES) -> Any:
    """The JSON value of a small file; malformed or absurdly nested is a ``GoodputError``."""
    text = read_text(path, max_bytes)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise GoodputError(path, f"is not valid JSON ({exc})", "restore or rewrite it") from None
    except RecursionError:
        raise nested_too_deeply(path, "restore or rewrite it") from None


def nested_too_deeply(where: object, fix: str) -> GoodputError:
    """The error for JSON whose arrays or objects nest past what ``json`` can parse (it
    recurses once per level): one phrase for every JSON reader."""
    return GoodputError(where, "is JSON nested too deeply", fix)


def read_lines(
    path: str | os.PathLike[str],
    max_line_bytes: int,
    *,
    fix: str,
    max_lines: int = MAX_LINES,
    skip_long: bool = False,
) -> Iterator[tuple[int, bytes]]:
    """(number, line) of each line of the regular file ``path``, numbered from 1, in order: the
    one reader of files line by line. A line keeps its ``b"\\n"``; the last one lacks it when the
    file does not end in one (its writer died, or is still writing it).

    Memory is bounded by ``max_line_bytes`` whatever the file holds: of a longer line (its
    newline not counted) no more than that is read before it is a ``GoodputError`` naming
    ``FILE:LINE``, or, with ``skip_long``, its rest is read past in bounded pieces and it is
    left out (its number still counts). More than ``max_lines`` lines is an error too; ``fix``
    is the errors' fix.
    """
    with open_regular(path) as stream:
        for number in range(1, max_lines + 2):
            line = _readline(stream, max_line_bytes + 1, path)
            if not line:
                return
            if number > max_lines:
                raise GoodputError(path, f"has more than {max_lines:,} lines", fix)
            if len(line) <= max_line_bytes or line.endswith(b"\n"):
                yield number, line
            elif skip_long:
                while (rest := _readline(stream, SKIP_BYTES, path)) and not rest.endswith(b"\n"):
                    pass
            else:
                raise GoodputError(
                    f"{path}:{number}", f"is a line longer than {max_line_bytes:,} bytes", fix
                )


def _readline(stream: BinaryIO, limit: int, path: str | os.PathLike[str]) -> bytes:
    try:
        return stream.readline(limit)
    except OSError as exc:
        raise GoodputError(path, f"cannot be read: {exc.strerror}", "check the disk") from None


def read_json_lines(
    path: str | os.PathLike[str], max_line_bytes: int, *, fix: str, max_lines: int = MAX_LINES
) -> Iterator[tuple[str, dict[str, Any]]]:
    """("FILE:LINE", object) of each line of the JSON-lines file ``path`` (``read_lines``): the
    one reader of goodput's run files (``metrics.jsonl``, ``evals.jsonl``, ``attempts.jsonl``).

    Strict: a line is one JSON object in UTF-8, without ``NaN`` or ``Infinity``; anything else
    is a ``GoodputError`` naming ``FILE:LINE``. Blank lines are passed over, and so is a last
    line without its newline: its writer was killed mid-line, or is writing it now.
    """
    for number, line in read_lines(path, max_line_bytes, fix=fix, max_lines=max_lines):
        if not line.endswith(b"\n"):
            return
        if line.strip():
            where = f"{path}:{number}"
            yield where, json_object(line, where, fix)


def json_object(line: bytes, where: str, fix: str) -> dict[str, Any]:
    """The JSON object ``line`` holds (strict, as ``read_json_lines``), or a ``GoodputError``
    naming ``where``."""
    try:
        raw = _STRICT_JSON.decode(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        what = f"is not a JSON line: invalid UTF-8 at byte {exc.start}"
        raise GoodputError(where, what, fix) from None
    except _NotJson as exc:
        raise GoodputError(where, f"is not a JSON line: {exc}", fix) from None
    except json.JSONDecodeError as exc:
        reason = f"{exc.msg.removesuffix(' at')} at column {exc.colno}"
        raise GoodputError(where, f"is not a JSON line: not valid JSON ({reason})", fix) from None
    except ValueError:  # an integer of too many digits
        raise GoodputError(where, "is not a JSON line: not valid JSON", fix) from None
    except RecursionError:
        raise nested_too_deeply(where, fix) from None
    if not isinstance(raw, dict):
        raise GoodputError(where, f"is {json_type_name(raw)}, not a JSON object", fix)
    return raw


class _NotJson(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not JSON")


# One decoder for every line: ``json.loads`` with an option builds a new one each call, a third
# of the time of a short line (100,000 steps' metrics.jsonl: a second).
_STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant)


_JSON_TYPE_NAMES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def json_type_name(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words ("an object", "a string"), for errors."""
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
