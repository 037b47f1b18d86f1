"""``goodput launch --auto-retry --evict-stragglers`` on a real run: two ``goodput train`` ranks,
rank 1 slowed by an injected ``slow`` fault, under an emulated PBS job whose ``PBS_NODEFILE``
names hosts n1-n3 (MPICH's real ``mpiexec -launcher fork`` runs every "host" here, as in
test_failover.py). The trainer names the straggler, saves and exits 4; the launcher puts the
spare n3 in n2's place and the next attempt resumes from that save and finishes.

Only the host names are emulated: the ranks reach each other at 127.0.0.1 (n1 resolves nowhere),
and ``LOCAL_WORLD_SIZE=1`` tells them one rank runs per host, as Hydra's own variables would on a
real machine. Processes, the save, the exit code and the resume are real.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from goodput.cli import main
from goodput.config import to_toml
from goodput.launch.history import read_attempts
from goodput.testing.jobs import outside_any_job
from goodput.testing.tiny import tiny_run_config
from goodput.train.config.run import WatchConfig

needs_mpiexec = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="needs MPICH's mpiexec (apt: mpich)"
)
STEPS, SAVE_EVERY, WINDOW = 8, 4, 3


def _emulated_job(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(the launcher's environment, the run's config file)."""
    (tmp_path / "nodefile").write_text("n1\nn2\nn3\n")
    profile = tmp_path / "emulated.toml"
    profile.write_text(
        textwrap.dedent(f"""\
            ppn = 1
            mpiexec = "hydra"
            mpiexec_args = ["-launcher", "fork"]
            health_check = ["{sys.executable}", "-c", "pass"]
        """)
    )
    cfg = tiny_run_config(tmp_path)
    cfg = replace(
        cfg,
        train=replace(cfg.train, steps=STEPS),
        checkpoint=replace(cfg.checkpoint, interval_steps=SAVE_EVERY),
        watch=WatchConfig(straggler_steps=WINDOW),
    )
    config = tmp_path / "run.toml"
    config.write_text(to_toml(cfg))
    # Rank 1 sleeps 0.2 s before each of steps 1-4 (a tiny step takes ~0.03 s): named after the
    # window of steps 2-4 (step 1 is warm-up, never judged), stopped after the save of step 4.
    slow = {"id": 0, "kind": "slow", "step": 1, "rank": 1, "seconds": 0.2, "steps": 4}
    plan = tmp_path / "faults.json"
    plan.write_text(json.dumps({"fired_dir": str(tmp_path / "fired"), "faults": [slow]}))
    env = outside_any_job(
        PBS_JOBID="4343.emulated",
        PBS_NODEFILE=str(tmp_path / "nodefile"),
        GOODPUT_PROFILE=str(profile),
        GOODPUT_FAULTS=str(plan),
        LOCAL_WORLD_SIZE="1",
        OMP_NUM_THREADS="1",
    )
    return env, config


@needs_mpiexec
def test_a_straggler_is_stopped_after_a_save_and_its_host_replaced(tmp_path):
    env, config = _emulated_job(tmp_path)
    run_dir = tmp_path / "launch"
    rank = ["env", "MASTER_ADDR=127.0.0.1", sys.executable, "-m", "goodput", "train", str(config)]
    argv = [sys.executable, "-m", "goodput", "launch", "--auto-retry", "--evict-stragglers"]
    argv += ["--nhosts", "2", "--timeout", "60", "--grace", "2", "--run-dir", str(run_dir)]
    result = subprocess.run(
        [*argv, "--", *rank], env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    evicted, resumed = read_attempts(run_dir / "attempts.jsonl")
    assert (evicted.class_, evicted.exit_code) == ("straggler", 4)
    assert evicted.last_step == SAVE_EVERY and evicted.replaced == {"n2": "n3"}
    (warned,) = evicted.evidence
    named = (warned.host, warned.rank, warned.source, warned.step)
    assert named == ("n2", 1, "straggler", 1 + WINDOW)
    assert warned.said.startswith("warning: straggler: rank 1 on n2 busy ")
    assert resumed.class_ == "success" and resumed.hosts == ("n1", "n3") and not resumed.evidence
    assert (resumed.first_step, resumed.last_step) == (SAVE_EVERY + 1, STEPS)
    assert f"stopping after the save of step {SAVE_EVERY}" in result.stdout + result.stderr
    assert "replaced n2 -> n3" in result.stderr


def test_evicting_without_auto_retry_is_a_usage_error(capsys):
    """As docs/launch.md shows it: nothing runs, and the line names the fix."""
    assert main(["launch", "--evict-stragglers", "--", "goodput", "train", "run.toml"]) == 2
    assert capsys.readouterr().err.strip() == (
        "goodput: error: --evict-stragglers: replaces hosts, which only --auto-retry does; "
        "add --auto-retry (and spare hosts: --nhosts N of a larger job)"
    )
