"""The environment for a child process that must not think it runs inside a job, the node of
this machine's Slurm that the Slurm tests run on, and the pids of the ranks a launcher runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import goodput
from goodput.launch.run import PROFILE_VAR
from goodput.launch.submit import CHAIN_JOB_VAR

REPO = Path(goodput.__file__).resolve().parents[1]
# Variables that would make a child read a placement, a profile or a chain position of the job
# the tests themselves may run in.
JOB_PREFIXES = ("SLURM_", "SBATCH_", "PBS_")
JOB_VARS = (PROFILE_VAR, CHAIN_JOB_VAR)


def outside_any_job(**extra: str) -> dict[str, str]:
    """This process's environment without any scheduler's or goodput's job variables, with this
    checkout first on PYTHONPATH; ``extra`` is set on top."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(JOB_PREFIXES) and k not in JOB_VARS
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, **extra}


def run_goodput(
    *argv: object,
    cwd: Path | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m goodput ARGV`` in a child, as a user runs it outside any job (``env`` on
    top), with its output captured as text; ``timeout`` fails a test that would block."""
    return subprocess.run(
        [sys.executable, "-m", "goodput", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=outside_any_job(**(env or {})),
        preexec_fn=preexec_fn,
    )


def slurm_node() -> str | None:
    """A node this machine's Slurm can run on now, or None (no Slurm, or no node answers)."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return None
    try:
        result = subprocess.run(
            ["sinfo", "-h", "-N", "-t", "idle,mix,alloc", "-o", "%N"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except subprocess.TimeoutExpired:
        return None
    nodes = result.stdout.split() if result.returncode == 0 else []
    return nodes[0] if nodes else None


def launched_rank_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of each child of ``launcher_pid`` that runs a rank now (its ``RANK``)."""
    found = {}
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # it just ended
                continue
            ranks = [item[5:] for item in environ if item.startswith(b"RANK=")]
            if ranks:
                found[int(ranks[0])] = int(pid)
    return found
