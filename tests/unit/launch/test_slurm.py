"""``goodput launch`` inside a real Slurm allocation, on the single-node Slurm of this machine.

CI starts it with ``.ci/start-slurm``; elsewhere these tests skip unless ``srun`` and ``sinfo``
are installed and a node answers. ``salloc`` runs its command on this host with the
allocation's ``SLURM_*`` variables set, so ``goodput launch`` reads its placement from a real
environment and starts real ``srun`` steps.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 60


def _slurm_node() -> str | None:
    """A node this machine's Slurm can run on now, or None."""
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


pytestmark = pytest.mark.skipif(
    _slurm_node() is None,
    reason="needs a running Slurm with a usable node (apt: slurm-wlm munge; .ci/start-slurm)",
)


def _child_env() -> dict[str, str]:
    """This environment, minus any job this test itself runs in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
    env.pop("GOODPUT_PROFILE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _salloc(ntasks: int, launch_args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``goodput launch LAUNCH_ARGS`` run by ``salloc`` in a fresh one-node allocation."""
    # --overcommit: two tasks fit a one-core node too (salloc passes it on to srun).
    salloc = ["salloc", "--nodes", "1", "--ntasks", str(ntasks), "--overcommit"]
    salloc += ["--time", "2", "--job-name", "goodput-test"]
    return subprocess.run(
        [*salloc, sys.executable, "-m", "goodput", "launch", *launch_args],
        cwd=cwd,
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_ranks_really_run_under_srun(tmp_path):
    code = "import os; print('rank', os.environ['SLURM_PROCID'], 'of', os.environ['SLURM_NTASKS'])"
    run_dir = tmp_path / "run"
    result = _salloc(
        2,
        ["--ppn", "2", "--timeout", "50", "--run-dir", str(run_dir)]
        + ["--", sys.executable, "-c", code],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(result.stdout.splitlines()) == ["[srun] rank 0 of 2", "[srun] rank 1 of 2"]
    assert "launch: slurm: 1 host(s) x 2 = 2 rank(s)" in result.stderr
    (record,) = (run_dir / "attempts.jsonl").read_text().splitlines()
    assert json.loads(record)["exit_code"] == 0


def test_dry_run_names_this_host_from_the_allocation(tmp_path):
    result = _salloc(1, ["--dry-run", "--", "true"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = result.stdout.splitlines()
    argv = shlex.split(line)
    srun = argv[argv.index("srun") :]
    node = _slurm_node()
    assert srun[srun.index("--nodelist") + 1] == node == socket.gethostname().split(".")[0]
    assert srun[-1] == "true" and "--kill-on-bad-exit=1" in srun
    assert f"MASTER_ADDR={node}" in argv[: argv.index("srun")]
    assert not list(tmp_path.iterdir())  # a dry run writes nothing
