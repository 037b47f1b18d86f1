"""User-given names and destinations of the data commands, checked before anything is written.

Owns three rules. A *name* that becomes part of a file name (``tokenize --name``, a shard named
in a manifest) is a plain file name: a letter or digit first, then letters, digits and ``._+-``,
no ``..``, at most ``MAX_NAME_CHARS`` characters — so every file made from it lands inside its
folder. A *destination* (``--output``) is checked up front, so a file where a folder should be,
a folder where a file should be, or a folder we may not write into is one line naming the option,
not an error half-way through a job. And a *file* is its ``(st_dev, st_ino)``: two paths, a
symbolic link or a hard link to one file are the same file.

It does not create, move or delete anything.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from goodput.errors import GoodputError, from_exception

MAX_NAME_CHARS = 100  # leaves room for the suffixes added to it within a 255-byte file name
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def is_safe_name(value: object) -> bool:
    """Whether ``value`` is a plain file name that cannot leave its folder."""
    return (
        isinstance(value, str)
        and len(value) <= MAX_NAME_CHARS
        and _NAME.fullmatch(value) is not None
        and ".." not in value
    )


def check_name(value: str, option: str) -> str:
    """``value`` if it is a safe name, else a usage error naming ``option``."""
    if not is_safe_name(value):
        raise GoodputError.usage(
            option,
            f"{value!r} is not a plain name (it becomes part of file names)",
            f"pass {option} with a letter or digit first, then letters, digits and ._+- "
            f"(no '..', at most {MAX_NAME_CHARS} characters)",
        )
    return value


def check_output_dir(path: Path, option: str) -> Path:
    """``path`` if it is a folder we can write into, or one we can create."""
    _check_nearest_existing_folder(path, path, option)
    return path


def check_output_file(path: Path, option: str) -> Path:
    """``path`` if it can be written as a file (it is replaced atomically if it exists)."""
    _check_nearest_existing_folder(path.parent, path, option)
    if path.is_dir():
        raise GoodputError.usage(
            f"{option} {path}", "is a folder, not a file", "pass the path of the file to write"
        )
    return path


def _check_nearest_existing_folder(folder: Path, given: Path, option: str) -> None:
    """``folder`` (``given`` or its parent) exists as a folder we may write into, or its nearest
    existing ancestor is one."""
    try:  # a folder on the way that we may not search raises here
        existing = next(p for p in (folder, *folder.parents) if p.exists() or p.is_symlink())
    except OSError as exc:
        raise from_exception(exc) from None
    if not existing.is_dir():
        what = "is a file" if existing == given else f"{existing} is a file"
        raise GoodputError.usage(
            f"{option} {given}", f"{what} where a folder should be", "fix the path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise GoodputError.usage(
            f"{option} {given}",
            f"permission denied: cannot write into {existing}",
            "choose a folder you can write into, or fix its permissions",
        )


def file_identity(path: Path) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of the file ``path`` reaches, links followed."""
    try:
        status = os.stat(path)
    except OSError as exc:
        raise from_exception(exc) from None
    return status.st_dev, status.st_ino
