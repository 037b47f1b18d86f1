"""What ``goodput ckpt list`` shows: every checkpoint of a run, complete or not, its size and
age, and which one ``latest`` names. Reads file metadata only; nothing here imports torch."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from goodput.errors import GoodputError
from goodput.io import is_folder, read_text
from goodput.rundir import LATEST, checkpoints_dir, list_checkpoints


def describe_checkpoints(run_dir: Path, now: float | None = None) -> dict[str, Any]:
    """``{"root", "latest", "checkpoints": [{step, path, complete, size_bytes, age_s,
    latest}]}``, oldest first."""
    root = checkpoints_dir(run_dir)
    if not is_folder(root):  # a loop of links is named as one
        raise GoodputError.usage(
            run_dir,
            f"has no {root.name}/ folder",
            "pass a run directory (train.run_dir) that has saved checkpoints",
        )
    now = time.time() if now is None else now
    latest_file = root / LATEST
    latest = _read_latest(latest_file) if latest_file.exists() else None
    rows = []
    for checkpoint in list_checkpoints(root):
        size, newest = _size_and_mtime(checkpoint.path)
        rows.append(
            {
                "step": checkpoint.step,
                "path": str(checkpoint.path),
                "complete": checkpoint.complete,
                "size_bytes": size,
                "age_s": max(now - newest, 0.0),
                "latest": checkpoint.path.name == latest,
            }
        )
    return {"root": str(root), "latest": latest, "checkpoints": rows}


def _read_latest(path: Path) -> str:
    """The step folder ``latest`` names; a broken file is shown, not fatal, in a listing."""
    try:
        return read_text(path, max_bytes=4096).strip()
    except GoodputError as exc:
        return f"nothing readable ({exc.what})"


def format_checkpoints(info: dict[str, Any]) -> str:
    rows = info["checkpoints"]
    if not rows:
        return f"{info['root']}: no checkpoints"
    lines = [f"{'step':>10}  {'complete':<10}  {'size':>9}  {'age':>7}"]
    for row in rows:
        lines.append(
            f"{row['step']:>10}  {'yes' if row['complete'] else 'INCOMPLETE':<10}  "
            f"{human_bytes(row['size_bytes']):>9}  {human_age(row['age_s']):>7}"
            + ("  <- latest" if row["latest"] else "")
        )
    latest = info["latest"]
    if latest is not None and not any(row["latest"] for row in rows):
        lines.append(f"latest names {latest}, which does not exist")
    return "\n".join(lines)


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f} {unit}"
    return f"{seconds:.0f} s"


def _size_and_mtime(directory: Path) -> tuple[int, float]:
    """Bytes of every file below ``directory`` and the newest modification time (a checkpoint
    being written keeps growing; its age is that of its last write)."""
    size, newest = 0, directory.stat().st_mtime
    for parent, _dirs, files in os.walk(directory):
        for name in files:
            try:
                stat = os.stat(os.path.join(parent, name))
            except FileNotFoundError:  # removed while we looked (pruning, a failed save)
                continue
            size += stat.st_size
            newest = max(newest, stat.st_mtime)
    return size, newest
