"""User-given names and destinations of the data commands, checked before anything is written.

Owns two rules. A *name* that becomes part of a file name (``tokenize --name``, a shard named
in a manifest) is a plain file name: a letter or digit first, then letters, digits and ``._+-``,
no ``..``, at most ``MAX_NAME_CHARS`` characters — so every file made from it lands inside its
folder. And a *file* is its ``(st_dev, st_ino)``: two paths, a
symbolic link or a hard link to one file are the same file.

Destinations (``--output``, ``--cache``) go through ``goodput.outputs``, like every
command's. It does not create, move or delete anything.
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


def file_identity(path: Path) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of the file ``path`` reaches, links followed."""
    try:
        status = os.stat(path)
    except OSError as exc:
        raise from_exception(exc) from None
    return status.st_dev, status.st_ino
