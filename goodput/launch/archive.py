"""One compressed archive of a folder, written once, for ``goodput broadcast --compress``.

``write_archive`` walks the source once, in one process, and streams a tar through ``zstd -1
-T0`` into one file on this machine's local disk (``$TMPDIR``, under a folder that ``broadcast``
removes afterwards): the shared filesystem is read exactly once, however many hosts the copies
go to; the first hops and every later hop send that file (or a host's copy of it) as it is. A
venv goes in as its staged copy: its files pointed at ``new_prefix`` (``transports.
venv_file_fixer``), the replaced files of its ``layers.VenvLayers`` plan, and each layer's
folder under ``layers.LAYERS_DIR``. The bytes read from the source are counted by the reader
(``ArchiveStats``), so a caller can say what the single read cost.

Invariants: entries are regular files, folders and symbolic links only (others skipped with a
note, as ``goodput.io.special_entries`` does for copies); names are relative (``./...``), so an
unpack lands inside its folder; a link goes in as a link and no entry lies under one (the walk
does not follow links, a venv file is read for its rewrite with ``io.read_inside``, and
``layers.plan_layers`` refuses a staged file behind a link), so the unpack writes through none;
the archive is complete only when zstd exited 0 (else a
``RuntimeError`` with its message). Does not send or unpack anything (``transports`` does).
Standard library only, and the ``zstd`` command.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from goodput.errors import GoodputError
from goodput.io import read_inside
from goodput.launch.layers import LAYERS_DIR, VenvLayers
from goodput.launch.transports import may_change, venv_file_fixer

ZSTD = ["zstd", "-1", "-T0", "-q", "-f"]  # level 1: the network, not the CPU, is the limit
COPY_BUFFER_BYTES = 1 << 20
ZSTD_TIMEOUT_S = 3600.0


@dataclass(slots=True)
class ArchiveStats:
    source_bytes_read: int = 0  # file bytes read from the source and its layers
    archive_bytes: int = 0  # the compressed file's size


class _CountingReader:
    """A file read through ``tarfile``, its bytes added to ``stats`` as they are read."""

    def __init__(self, file: IO[bytes], stats: ArchiveStats) -> None:
        self.file = file
        self.stats = stats

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.stats.source_bytes_read += len(data)
        return data


def require_zstd() -> None:
    if shutil.which("zstd") is None:
        raise GoodputError.usage(
            "--compress",
            "needs the zstd command on this machine and every host",
            "install it (apt-get install zstd), or drop --compress",
        )


def _walk(top: Path, prefix: str) -> Iterator[tuple[str, Path]]:
    """``(name in the archive, path)`` for ``top`` and everything under it, links not followed,
    in a stable order."""
    yield prefix, top
    for root, dirs, files in os.walk(top):
        dirs.sort()
        rel = os.path.relpath(root, top)
        base = prefix if rel == "." else f"{prefix}/{rel}"
        for name in sorted(dirs + files):
            yield f"{base}/{name}", Path(root, name)


def _entries(source: Path, staging: VenvLayers | None) -> Iterator[tuple[str, Path]]:
    yield from _walk(source, ".")
    if staging is not None and staging.layers:
        yield f"./{LAYERS_DIR}", source  # the folder itself, with the source's mode
        for layer in staging.layers:
            yield from _walk(layer.source, f"./{LAYERS_DIR}/{layer.name}")


def _add(
    tar: tarfile.TarFile,
    name: str,
    path: Path,
    content: Callable[[str], bytes | None],
    stats: ArchiveStats,
) -> None:
    """One entry: the file's bytes, or ``content``'s replacement for them."""
    info = tar.gettarinfo(str(path), arcname=name)  # None for a socket
    if info is None or not (info.isreg() or info.isdir() or info.issym() or info.islnk()):
        print(f"goodput: note: skipping {path}: not a regular file", file=sys.stderr)
        return
    replaced = None if info.isdir() else content(name[2:])
    if replaced is not None:  # a link replaced too: the copy gets the staged file, not the link
        info.type, info.linkname, info.size = tarfile.REGTYPE, "", len(replaced)
        tar.addfile(info, _BytesReader(replaced))
    elif info.isreg():  # a hard link's second name is not (LNKTYPE): tar adds no bytes
        with open(path, "rb") as file:
            tar.addfile(info, _CountingReader(file, stats))  # type: ignore[arg-type]
    else:
        tar.addfile(info)


def _add_new_files(tar: tarfile.TarFile, source: Path, staging: VenvLayers | None) -> None:
    """The staged files the source does not have (``layers.LAYERS_PTH``)."""
    for name, data in (staging.replaced if staging is not None else {}).items():
        if not os.path.lexists(source / name):
            info = tarfile.TarInfo(f"./{name}")
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            tar.addfile(info, _BytesReader(data))


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)

    def read(self, size: int = -1) -> bytes:
        size = len(self.data) if size < 0 else size
        chunk, self.data = self.data[:size], self.data[size:]
        return bytes(chunk)


def _content(
    source: Path,
    staging: VenvLayers | None,
    prefix: tuple[str, str] | None,
    stats: ArchiveStats,
) -> Callable[[str], bytes | None]:
    """``content(name)``: the staged bytes of the file at ``name`` (relative to ``source``) when
    its bytes change, else None."""
    replaced = staging.replaced if staging is not None else {}
    fix = venv_file_fixer(*prefix) if prefix is not None else None

    def content(name: str) -> bytes | None:
        data = replaced.get(name)
        if fix is None or not may_change(name):
            return data
        if data is None:
            # The source's own file, no link followed: a link (bin/python) goes in as it is.
            found = read_inside(source, name)
            if found is None:
                return None
            data = found[0]
            stats.source_bytes_read += len(data)
        return fix(name, data)

    return content


def write_archive(
    source: Path,
    archive: Path,
    *,
    staging: VenvLayers | None = None,
    prefix: tuple[str, str] | None = None,
) -> ArchiveStats:
    """Write ``source`` (staged by ``staging``, its venv prefix moved ``prefix`` = (old, new))
    to ``archive`` as tar + zstd, reading every source file once."""
    stats = ArchiveStats()
    content = _content(source, staging, prefix, stats)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_broken_pipe_as_error())
        err = stack.enter_context(tempfile.TemporaryFile())
        zstd = subprocess.Popen([*ZSTD, "-o", str(archive)], stdin=subprocess.PIPE, stderr=err)
        stack.callback(_reap, zstd)
        assert zstd.stdin is not None
        try:
            with tarfile.open(
                fileobj=zstd.stdin,
                mode="w|",
                bufsize=COPY_BUFFER_BYTES,
                format=tarfile.PAX_FORMAT,
            ) as tar:
                # tarfile reads 16 KiB at a time by default; typeshed lacks the attribute.
                tar.copybufsize = COPY_BUFFER_BYTES  # type: ignore[attr-defined]
                for name, path in _entries(source, staging):
                    _add(tar, name, path, content, stats)
                _add_new_files(tar, source, staging)
        except BrokenPipeError:
            pass  # zstd died: its exit status and message below say why
        finally:
            with contextlib.suppress(BrokenPipeError):  # the flush of what zstd never read
                zstd.stdin.close()
        zstd.wait(timeout=ZSTD_TIMEOUT_S)
        if zstd.returncode != 0:
            err.seek(0)
            said = " ".join(err.read(4096).decode(errors="replace").split())
            raise RuntimeError(f"zstd exited {zstd.returncode} writing {archive}: {said}")
    stats.archive_bytes = archive.stat().st_size
    return stats


@contextlib.contextmanager
def _broken_pipe_as_error() -> Iterator[None]:
    """SIGPIPE ignored while this thread writes to zstd. The CLI restores its default (so that
    ``goodput ... | head`` ends quietly), under which a zstd that dies would kill goodput without
    a word; ignored, the write raises ``BrokenPipeError`` and zstd's own message is shown."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set a handler; the CLI writes from it
        return
    previous = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGPIPE, previous)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
