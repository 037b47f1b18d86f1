"""A process's figures from Linux's ``/proc/<pid>/status``, for the benchmarks and the tests that
measure memory: ``status_kib("VmHWM", pid)`` is a child's own peak while it runs (``ru_maxrss``
from ``wait4`` keeps the parent's peak across exec), ``status_kib("VmRSS")`` this process's
resident set now. (A rank's own peak for its metrics is ``train.device.process_peak_bytes``.)"""

from __future__ import annotations

from pathlib import Path


def status_kib(field: str, pid: int | str = "self") -> int:
    """The ``kB`` field ``field`` of process ``pid``'s status; 0 where there is no such process,
    field or /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    prefix = f"{field}:"
    return next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith(prefix)), 0
    )
