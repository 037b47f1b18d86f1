"""The launcher's beacon folders: one host-local folder per attempt, where each rank keeps its
beacon and its stack file (``goodput.beacon``), and their removal.

``{/dev/shm, else the temporary folder}/goodput-{uid}-{job id, or local}-{launcher pid}/
attempt-{N}``, each level mode 0700 and this user's (a folder there that is a symlink, someone
else's or open to others is refused: another user could plant or read files in it). The name
is the same on every host: the ranks on other hosts create it there themselves
(``beacon.open_beacon``). The launcher removes its own host's attempt folder after the attempt,
and the launch's folder at the end, deleting only what goodput wrote: a regular file of this
user's, not a symlink, named as a beacon or stack file (or their temporary names), that starts
with the beacon's magic or the stack file's header. Anything else stays, and so does its folder.
Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from pathlib import Path

from goodput import beacon
from goodput.errors import GoodputError

SHM = Path("/dev/shm")
MAX_ENTRIES = 10_000  # far past a host's ranks x 2 files; a folder with more is not ours alone
# beacon.beacon_path, beacon.stack_path, and the temporary names they are written under.
OWN_NAME = re.compile(r"\.?rank-[0-9]{5,8}\.(beacon|stack)(\.tmp-[0-9]{1,10})?")


def launch_folder(job_id: str | None, *, base: Path | None = None) -> Path:
    """This launch's folder (not created): under ``base``, else /dev/shm, else the temp folder."""
    if base is None:
        base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK | os.X_OK) else None
    root = base if base is not None else Path(tempfile.gettempdir())
    return root / f"goodput-{os.getuid()}-{job_id or 'local'}-{os.getpid()}"


def make_private(folder: Path) -> Path:
    """Create ``folder`` (mode 0700), or accept it as it is if it is already a private folder
    of this user's; anything else is a GoodputError naming it."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    ):
        raise GoodputError(
            folder,
            "is not a private folder of this user (a symlink, someone else's, or open to others)",
            "remove it; goodput makes the beacon folders itself, mode 0700",
        )
    return folder


def attempt_folder(launch: Path, attempt: int) -> Path:
    """The attempt's folder under ``launch``, both made private (``make_private``), without the
    files an earlier launch of this process left in it (a chaos campaign launches many times):
    a stale beacon would read as a rank that is gone."""
    make_private(launch)
    folder = launch / f"attempt-{attempt}"
    remove_folder(folder)
    return make_private(folder)


def remove_folder(folder: Path) -> list[str]:
    """Delete the files goodput wrote in ``folder`` (module docstring), then the folder if it is
    empty; the names of what was left behind."""
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return [folder.name]
    left = []
    with os.scandir(folder) as entries:
        for count, entry in enumerate(entries):
            if count == MAX_ENTRIES:
                left.append("...")
                break
            if entry.is_dir(follow_symlinks=False) and entry.name.startswith("attempt-"):
                left += remove_folder(Path(entry.path))
            elif not _remove_own(Path(entry.path)):
                left.append(entry.name)
    if not left:
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    return left


def _remove_own(path: Path) -> bool:
    """Unlink ``path`` if goodput wrote it; whether it did."""
    match = OWN_NAME.fullmatch(path.name)
    if match is None:
        return False
    head = beacon.MAGIC if match[1] == "beacon" else beacon.STACK_HEADER
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        ours = stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()
        ours = ours and os.pread(fd, len(head), 0) == head
    except OSError:
        ours = False
    finally:
        os.close(fd)
    if ours:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return ours
