"""The environment for a child process that must not think it runs inside a job."""

from __future__ import annotations

import os
from pathlib import Path

import goodput

REPO = Path(goodput.__file__).resolve().parents[1]
# Variables that would make a child read a placement, a profile or a chain position of the job
# the tests themselves may run in.
JOB_PREFIXES = ("SLURM_", "SBATCH_", "PBS_")
JOB_VARS = ("GOODPUT_PROFILE", "GOODPUT_CHAIN_JOB")


def outside_any_job(**extra: str) -> dict[str, str]:
    """This process's environment without any scheduler's or goodput's job variables, with this
    checkout first on PYTHONPATH; ``extra`` is set on top."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(JOB_PREFIXES) and k not in JOB_VARS
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, **extra}
