"""Where in-memory checkpoints live on a host, and their files read and written as untrusted.

Folders: ``{memory_dir}/goodput-{uid}/{run_key}/{host}/``, every level a real folder of this
user, mode 0700 (``ensure_private_dir``): inside, only this user can create or swap files, so a
file checked with ``lstat`` stays what was checked. Files: ``rank-00003.slot-0.bin|json`` (this
rank's own), ``held-00001.slot-1.bin|json`` (the copy held for rank 1, byte-identical to its
owner's), ``SLOTS`` of each; ``SNAPSHOT_FILE`` matches every name goodput writes here and
nothing else.

Trust: ``read_manifest`` reads only a regular file of this user (not a link), at most
``MAX_MANIFEST_BYTES``, without following links or blocking, then parses it as strictly as
``format.parse_manifest`` does; ``own_file`` checks a payload before it is mapped. Anything
else is a ``GoodputError`` naming the file.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Literal

from goodput.checkpoint.snapshot.format import (
    FIX,
    HEX16,
    MAX_MANIFEST_BYTES,
    MAX_WORLD,
    Manifest,
    brief,
    manifest_bytes,
    parse_manifest,
)
from goodput.errors import GoodputError
from goodput.io import NotOwnFile, open_own_file, path_status, resolved, write_bytes
from goodput.ranks import HOSTNAME

SLOTS = 2  # per kind: the newest committed snapshot and the one being written
SNAPSHOT_FILE = re.compile(r"(?:rank|held)-[0-9]{5,8}\.slot-[0-9]\.(?:bin|json)")
Kind = Literal["own", "held"]
_PREFIX: dict[str, str] = {"own": "rank", "held": "held"}


def run_key(checkpoint_root: Path) -> str:
    """16 hex of the SHA-256 of the checkpoint root's resolved absolute path: one run's
    snapshots, whatever the relative spelling of its root."""
    return hashlib.sha256(str(resolved(checkpoint_root)).encode()).hexdigest()[:16]


def memory_root(memory_dir: str | None) -> Path:
    """``memory_dir`` when set, if it is a folder (a usage error naming the key and the path
    otherwise: a file there would be named only as the folder below it that cannot be made);
    else ``/dev/shm`` when it is a writable folder (tmpfs: pages outlive the process, not the
    host), else the temp folder."""
    if memory_dir is not None:
        status = path_status(memory_dir)  # a loop of links is named as one
        where = f"checkpoint.memory_dir {memory_dir}"
        if status is None:
            raise GoodputError.usage(
                where, "does not exist", "create the folder, or leave memory_dir out (/dev/shm)"
            )
        if not stat.S_ISDIR(status.st_mode):
            raise GoodputError.usage(
                where,
                "is a file, not a folder",
                "set memory_dir to a folder (the snapshots go in a private folder inside it), "
                "or leave it out (/dev/shm)",
            )
        return Path(memory_dir)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def user_folder(memory_dir: Path) -> Path:
    """``memory_dir/goodput-{uid}``: the top of this user's private snapshot folders."""
    return Path(memory_dir) / f"goodput-{os.getuid()}"


def host_folder(memory_dir: Path, run_key: str, host: str) -> Path:
    """``memory_dir/goodput-{uid}/{run_key}/{host}``: one host's snapshots of one run."""
    if not HEX16.fullmatch(run_key):
        raise ValueError(f"run key {run_key!r} is not 16 hex digits")
    if not HOSTNAME.fullmatch(host):
        raise GoodputError(
            "memory snapshots",
            f"host name {brief(host)} is not a host name",
            "check the launcher's host file (GOODPUT_HOSTFILE)",
        )
    return user_folder(memory_dir) / run_key / host


def payload_name(kind: Kind, rank: int, slot: int) -> str:
    """``rank-00003.slot-0.bin`` (own) or ``held-00003.slot-0.bin`` (held for rank 3)."""
    return f"{_stem(kind, rank, slot)}.bin"


def manifest_name(kind: Kind, rank: int, slot: int) -> str:
    """``rank-00003.slot-0.json`` (own) or ``held-00003.slot-0.json`` (held for rank 3)."""
    return f"{_stem(kind, rank, slot)}.json"


def _stem(kind: Kind, rank: int, slot: int) -> str:
    if kind not in _PREFIX or not 0 <= rank < MAX_WORLD or not 0 <= slot < SLOTS:
        raise ValueError(f"no snapshot file for {kind!r} rank {rank} slot {slot}")
    return f"{_PREFIX[kind]}-{rank:05d}.slot-{slot}"


def ensure_private_dir(path: Path) -> Path:
    """``path`` (below a ``goodput-{uid}`` folder), created 0700 with its parents from that
    folder down; each level must be a real folder (not a link) of this user, else a
    ``GoodputError`` naming it. A level of ours open to others is closed (chmod 0700)."""
    path = Path(path)
    top = f"goodput-{os.getuid()}"
    if top not in path.parts:
        raise ValueError(f"{path} is not below a {top} folder")
    start = len(path.parts) - path.parts[::-1].index(top)
    for depth in range(start, len(path.parts) + 1):
        _private_level(Path(*path.parts[:depth]))
    return path


def _private_level(level: Path) -> None:
    fix = "remove it, or set [checkpoint] memory_dir to a folder of yours"
    try:
        os.mkdir(level, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise GoodputError(
            level.parent,
            "does not exist",
            "create it, or set [checkpoint] memory_dir to an existing folder (default /dev/shm)",
        ) from None
    except OSError as exc:
        raise GoodputError(level, f"cannot be created ({exc.strerror or exc})", fix) from None
    info = os.lstat(level)
    if stat.S_ISLNK(info.st_mode):
        raise GoodputError(level, "is a symbolic link, not a snapshot folder", fix)
    if not stat.S_ISDIR(info.st_mode):
        raise GoodputError(level, "is not a folder", fix)
    if info.st_uid != os.getuid():
        raise GoodputError(level, f"is owned by uid {info.st_uid}, not this user", fix)
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(level, 0o700)


def own_file(path: Path) -> os.stat_result:
    """The ``fstat`` of ``path`` if it is a regular file (not a link) of this user; a
    ``GoodputError`` otherwise, a missing file too. Inside a ``ensure_private_dir`` folder
    nobody else can swap the file after this check."""
    try:
        fd, info = open_own_file(path)
    except NotOwnFile as refused:
        raise _bad_file(path, refused.reason) from None
    os.close(fd)
    return info


def _os_error(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "is missing"
    return f"cannot be read ({exc.strerror or exc})"


def _bad_file(path: Path, what: str) -> GoodputError:
    return GoodputError(path, f"memory snapshot file {what}", FIX)


def read_manifest(path: Path) -> Manifest:
    """The manifest in ``path``: a regular file of this user, not a link, at most
    ``MAX_MANIFEST_BYTES``, read without following links or blocking, then ``parse_manifest``."""
    try:
        fd, info = open_own_file(path)
    except NotOwnFile as refused:
        raise _bad_file(path, refused.reason) from None
    try:
        if info.st_size > MAX_MANIFEST_BYTES:
            raise _bad_file(path, f"is larger than {MAX_MANIFEST_BYTES:,} bytes")
        data = _read_at_most(fd, MAX_MANIFEST_BYTES + 1, path)
    finally:
        os.close(fd)
    return parse_manifest(data, str(path))


def _read_at_most(fd: int, limit: int, path: Path) -> bytes:
    parts = []
    size = 0
    while size < limit:
        try:
            part = os.read(fd, min(limit - size, 1 << 20))
        except OSError as exc:
            raise _bad_file(path, _os_error(exc)) from None
        if not part:
            break
        parts.append(part)
        size += len(part)
    return b"".join(parts)


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Write ``manifest`` to ``path`` atomically (temp name, fsync, rename): call it last."""
    write_bytes(path, manifest_bytes(manifest))
