"""``goodput chaos`` with in-memory checkpoints on, through the real CLI, as a user runs it: the
issue's campaign on 2 local CPU ranks of the tiny config (ranks really SIGKILLed after a step, in a
checkpoint flush and in a snapshot's write, one really SIGSTOPped), and a host lost under an
emulated PBS job (hosts n1-n3, MPICH's real ``mpiexec -launcher fork``, as in
tests/unit/launch/test_retry_eviction.py): the faulted rank's host folder of snapshots is removed,
the launcher evicts the host for the spare n3, and the rank on n3 loads its state from its partner's
copy on the other host. Each campaign must end bitwise equal to its straight run, with at most k
steps lost per fault and each restart's source in report.json.

Only the host names are emulated (every "host" is this machine; ``LOCAL_WORLD_SIZE=1`` and
``MASTER_ADDR=127.0.0.1`` as Hydra's variables would give on a real machine); a host's memory
is its folder under ``checkpoint.memory_dir``, named by the host, so a spare starts with none.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from goodput import rundir
from goodput.chaos.outcomes import ENDS_ATTEMPT
from goodput.config import to_toml
from goodput.launch.history import read_attempts
from goodput.runfiles import RESUMED_FROM
from goodput.testing.jobs import outside_any_job
from goodput.testing.tiny import tiny_run_config

needs_mpiexec = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="needs MPICH's mpiexec (apt: mpich)"
)
# A stopped rank is past SIGTERM's reach: a short grace; steps print every few hundredths of a
# second, start-up is silent for seconds: a short idle bound and a start-up bound of its own.
LAUNCH_OPTIONS = ["--grace", "1", "--timeout", "3", "--startup-timeout", "30"]


def write_config(tmp_path: Path, *, steps: int, saves_every: int) -> Path:
    """The tiny config, saving to disk every ``saves_every`` steps: rarely enough that a bound
    of k steps lost comes from the in-memory checkpoints."""
    cfg = tiny_run_config(tmp_path)
    cfg = replace(
        cfg,
        train=replace(cfg.train, steps=steps),
        checkpoint=replace(cfg.checkpoint, interval_steps=saves_every),
    )
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(cfg))
    return config


def goodput_chaos(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "goodput", "chaos", *args]
    started = time.monotonic()
    result = subprocess.run(
        argv, env=outside_any_job(**env), capture_output=True, text=True, timeout=600
    )
    print(f"campaign: {time.monotonic() - started:.1f} s")  # the CI budget
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def memory_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "shm"  # node-local memory, emulated: a folder of this test's
    folder.mkdir()
    return folder


@pytest.mark.timeout(600)
def test_kills_a_snapshot_kill_and_a_hang_lose_at_most_one_step_and_end_bitwise_equal(tmp_path):
    config, out, shm = (
        write_config(tmp_path, steps=20, saves_every=5),
        tmp_path / "c",
        memory_dir(tmp_path),
    )
    kinds = "kill,snapshot-kill,hang,ckpt-kill"
    # Seed 6 places no fault at step 1 (its plan: snapshot-kill 4, kill 8, ckpt-kill 10, hang
    # 12). A fault there races the first snapshot's background write: nothing earlier is settled,
    # so a restart may rightly start over (a step lost, loaded from nowhere; seen in CI).
    result = goodput_chaos(
        [str(config), "--nproc", "2", "checkpoint.memory_interval_steps=1",
         f"checkpoint.memory_dir={shm}", "--kinds", kinds, "--faults", "4", "--seed", "6",
         "--output", str(out), "--", *LAUNCH_OPTIONS],
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["comparison"]["equal"]
    assert report["memory_interval_steps"] == 1
    faults = {fault["kind"]: fault for fault in report["faults"]}
    assert sorted(faults) == sorted(kinds.split(","))
    assert min(fault["step"] for fault in report["faults"]) > 1, "the plan changed: pick a seed"
    for fault in report["faults"]:  # each ended its attempt; the next loaded, and said from where
        assert fault["kind"] in ENDS_ATTEMPT and fault["fired_step"] == fault["step"], fault
        assert fault["loaded_from"] in RESUMED_FROM and 0 <= fault["steps_lost"] <= 1, fault
    # A kill after a step, or in a snapshot's write, resumes from a snapshot (one host: its
    # own); the snapshot the rank died writing is never loaded, the one before it is.
    assert faults["kill"]["loaded_from"] == "snapshot"
    snap = faults["snapshot-kill"]
    assert snap["loaded_from"] == "snapshot" and snap["resumed_step"] == snap["fired_step"] - 1
    assert "memory snapshots every 1 step(s): each of the 4 fault(s)" in result.stdout
    header = next(line for line in result.stdout.splitlines() if line.startswith("  id "))
    assert "  lost  from  " in header
    # A finished run leaves no snapshot behind (an attempt's error exit keeps its files).
    assert not [path for path in shm.rglob("*") if path.is_file()]


def emulated_job(tmp_path: Path) -> dict[str, str]:
    """An emulated PBS job of hosts n1-n3: its environment for goodput chaos."""
    (tmp_path / "nodefile").write_text("n1\nn2\nn3\n")
    profile = tmp_path / "emulated.toml"
    # The ranks rendezvous at 127.0.0.1 (n1 resolves nowhere): Hydra takes the last -genv.
    profile.write_text(
        'ppn = 1\nmpiexec = "hydra"\n'
        'mpiexec_args = ["-launcher", "fork", "-genv", "MASTER_ADDR", "127.0.0.1"]\n'
        f'health_check = ["{sys.executable}", "-c", "pass"]\n'
    )
    return {
        "PBS_JOBID": "4343.emulated",
        "PBS_NODEFILE": str(tmp_path / "nodefile"),
        "GOODPUT_PROFILE": str(profile),
        "LOCAL_WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "1",
    }


@needs_mpiexec
@pytest.mark.timeout(600)
def test_a_lost_host_is_replaced_and_its_rank_loads_its_partners_copy(tmp_path):
    config, out, shm = (
        write_config(tmp_path, steps=16, saves_every=8),
        tmp_path / "c",
        memory_dir(tmp_path),
    )
    result = goodput_chaos(
        [str(config), "--nproc", "2", "checkpoint.memory_interval_steps=2",
         f"checkpoint.memory_dir={shm}", "--kinds", "host-loss,kill", "--faults", "2",
         "--output", str(out), "--", "--nhosts", "2", *LAUNCH_OPTIONS],
        **emulated_job(tmp_path),
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["comparison"]["equal"]
    faults = {fault["kind"]: fault for fault in report["faults"]}
    lost = faults["host-loss"]
    assert lost["loaded_from"] == "partner" and 0 <= lost["steps_lost"] <= 2
    assert 0 <= faults["kill"]["steps_lost"] <= 2
    # Evicted as a bad node is, on the device-error line, the spare in its place.
    attempts = read_attempts(out / "faulted" / rundir.ATTEMPTS)
    ended, back = attempts[lost["attempt"] - 1], attempts[lost["attempt"]]
    assert ended.class_ == "bad-node" and ended.replaced == {lost["host"]: "n3"}
    (evidence,) = ended.evidence
    assert evidence.host == lost["host"]
    assert f"rank {lost['rank']} on {lost['host']}: CUDA error: device lost" in evidence.said
    assert "n3" in back.hosts and lost["host"] not in back.hosts
    assert f"replaced {lost['host']} -> n3" in result.stderr
    log = (out / "faulted" / "launch.log").read_text()
    assert "rank(s) from a partner's copy) loaded in" in log
