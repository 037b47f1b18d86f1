"""A folder's whole content as one comparable value, for tests of copies (broadcast, archive)."""

from __future__ import annotations

import os
import stat
from collections.abc import Collection
from pathlib import Path


def file_tree(folder: Path, *, skip: Collection[str] = ()) -> dict[str, tuple[int, bytes]]:
    """Every entry under ``folder`` but the relative paths in ``skip``: its mode (type and
    permissions), and its bytes or a symlink's target."""
    entries = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if name in skip:
            continue
        mode = path.lstat().st_mode
        data = os.readlink(path).encode() if path.is_symlink() else b""
        if stat.S_ISREG(mode):
            data = path.read_bytes()
        entries[name] = (mode, data)
    return entries
