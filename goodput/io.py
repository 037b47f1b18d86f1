"""Atomic file writes, completion markers, checksums, and strict reads of small files.

Invariant: a file that others read appears under its final name only when complete. Writers go
through a temp name in the same directory, fsync, then ``os.replace``; directories that carry a
marker count only once the marker exists, and the marker is always written last.
``read_text`` and ``read_json`` are the one way to read a small text file from outside (configs,
host files, manifests, checkpoint metadata): bounded in size, strict UTF-8, and every way it can
be broken is a ``GoodputError`` naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from goodput.errors import GoodputError, from_exception

CHUNK_BYTES = 8 << 20
SMALL_FILE_BYTES = 64 << 20  # configs, manifests, host files, checkpoint JSON: far below this


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
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_marker(directory: str | os.PathLike[str], name: str = ".complete") -> Path:
    """Write the completion marker of ``directory``. Call it last."""
    marker = Path(directory) / name
    write_text(marker, "")
    return marker


def is_complete(directory: str | os.PathLike[str], name: str = ".complete") -> bool:
    return (Path(directory) / name).is_file()


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hash of a JSON-serialisable value, independent of dict order."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def read_bytes(path: str | os.PathLike[str], max_bytes: int = SMALL_FILE_BYTES) -> bytes:
    """The bytes of a file of at most ``max_bytes``; larger or unreadable: a ``GoodputError``."""
    try:
        with open(path, "rb") as f:
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
        raise GoodputError(path, "is JSON nested too deeply", "restore or rewrite it") from None


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
