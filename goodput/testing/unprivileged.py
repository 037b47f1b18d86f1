"""``goodput`` as a child process for which file modes hold, even when the tests run as root
(as CI does): the tests of "permission denied" need a refusal root would never get."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2  # <linux/prctl.h>, capability.h


def _drop_file_permission_override() -> None:
    """Root ignores file modes through two capabilities; drop them for the child's exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_goodput(*argv: object) -> subprocess.CompletedProcess[str]:
    """``python -m goodput ARGV`` with root's override of file modes dropped."""
    return subprocess.run(
        [sys.executable, "-m", "goodput", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_drop_file_permission_override if os.geteuid() == 0 else None,
    )
