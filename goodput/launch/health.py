"""The default per-host health probe: ``python -m goodput.launch.health``.

``goodput launch --auto-retry`` runs it on each active host (one process per host, through the
job's own srun or mpiexec) when an attempt failed and no log line named a culprit, so that a
host is evicted on evidence, never by a blind pick. It checks what a training rank needs first
and what silently breaks on a sick node: that Python starts at all (the probe running is the
check), that node-local temporary space and ``/dev/shm`` take a write that reads back, and that
the temporary space has room. Exit 0 and one ``healthy`` line, or exit 1 and one line naming
the failed check. Device checks are site-specific (``nvidia-smi``, ``xpu-smi`` ...): a machine
profile replaces this probe with its own command through ``health_check``.
Standard library only: it must start fast on a node that may be half broken.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

PROBE_BYTES = 1 << 20
MIN_FREE_BYTES = 1 << 30


def _write_reads_back(folder: Path) -> None:
    payload = os.urandom(PROBE_BYTES)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".goodput-health-") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
        handle.seek(0)
        if handle.read() != payload:
            raise OSError(f"{folder}: data read back differs from data written")


def check() -> str | None:
    """None when healthy, else what failed."""
    folders = [Path(tempfile.gettempdir())]
    if Path("/dev/shm").is_dir():
        folders.append(Path("/dev/shm"))
    try:
        for folder in folders:
            _write_reads_back(folder)
        free = shutil.disk_usage(folders[0]).free
    except OSError as error:
        return f"{error.filename or ''} {error.strerror or error}".strip()
    if free < MIN_FREE_BYTES:
        return f"{folders[0]}: {free / 2**20:.0f} MiB free, want at least 1 GiB"
    return None


def main() -> int:
    host = os.environ.get("GOODPUT_PROBE_HOST") or socket.gethostname()
    problem = check()
    print(f"health: {host}: {'healthy' if problem is None else 'unhealthy: ' + problem}")
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())
