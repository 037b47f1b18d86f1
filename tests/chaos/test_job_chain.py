"""Job chains under the real single-node Slurm (CI starts it with ``.ci/start-slurm``), with a real
2-rank ``goodput train`` in every job.

A chain whose jobs cannot start ends after two of them, loudly, and a new chain starts once the
cause is fixed; a chain whose jobs hit the one-minute walltime carries the run across jobs
(SIGTERM, synchronous save, exit 143, the next job resumes) until ``done``. Slurm enforces a
time limit on a timer of its own (every 30 s here), so a one-minute job ends 60 to 90 s in.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from goodput.config import to_toml
from goodput.launch.history import read_attempts
from goodput.testing.jobs import outside_any_job
from goodput.testing.tiny import tiny_run_config
from goodput.train.config.run import RunConfig

BIN = Path(sys.executable).parent  # the jobs find this venv's goodput on PATH
# Seconds of training at the speed measured just before the chain: more than a one-minute job
# holds (60 to 90 s, start-up included), so the first job cannot finish and a second one, or a
# third when the machine slows down, carries the run to the end.
TRAIN_S = 120.0


def _slurm_up() -> bool:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    argv = ["sinfo", "-h", "-t", "idle,mix,alloc", "-o", "%N"]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0 and bool(result.stdout.split())


pytestmark = pytest.mark.skipif(
    not _slurm_up(),
    reason="needs a running Slurm with a usable node (apt: slurm-wlm munge; .ci/start-slurm)",
)


def _env() -> dict[str, str]:
    # One thread a rank: two ranks share this machine's cores with whatever else runs.
    path = os.pathsep.join([str(BIN), os.environ["PATH"]])
    return outside_any_job(PATH=path, OMP_NUM_THREADS="1")


def _jobs(name: str, *states: str) -> list[tuple[str, str]]:
    """(id, state) of the jobs named ``name``, oldest first: those queued or running, or any
    state Slurm still remembers with ``"all"``."""
    argv = ["squeue", "-h", "-n", name, "-o", "%i %T", *(["-t", *states] if states else [])]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=10).stdout
    rows = [row.split() for row in out.splitlines()]
    return sorted(((job, state) for job, state in rows), key=lambda row: int(row[0]))


def _run_chain(
    tmp_path: Path, run_dir: Path, config: Path, *, name: str, max_jobs: int, timeout_s: float
) -> list[tuple[str, str]]:
    """``goodput submit --submit`` a chain of 2-rank ``goodput train CONFIG`` with a one-minute
    walltime; wait until none of its jobs is queued or running; return all its jobs (those of
    an earlier chain of the same name left out)."""
    submit = ["goodput", "submit", "--submit", "--nhosts", "1", "--time", "00:01:00"]
    submit += ["--max-jobs", str(max_jobs), "--job-name", name, "--run-dir", str(run_dir)]
    launch = ["goodput", "launch", "--nproc", "2", "--run-dir", str(run_dir)]
    argv = [*submit, "--", *launch, "--", "goodput", "train", str(config)]
    try:
        result = subprocess.run(
            argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        deadline = time.monotonic() + timeout_s
        while _jobs(name):
            assert time.monotonic() < deadline, f"chain still queued: {_jobs(name)}"
            time.sleep(1)
    finally:  # after a failure, cancel what is left of this chain
        if leftover := [job for job, _ in _jobs(name)]:
            subprocess.run(["scancel", *leftover], check=False)
    first = int(result.stdout)  # goodput submit prints job 1's id
    return [(job, state) for job, state in _jobs(name, "all") if int(job) >= first]


def _job_log(run_dir: Path, job: str) -> str:
    (log,) = run_dir.glob(f"chain-*-{job}.out")
    return log.read_text(errors="replace")


def _write_config(cfg: RunConfig, path: Path, **train: object) -> Path:
    path.write_text(to_toml(replace(cfg, train=replace(cfg.train, **train))))
    return path


def test_a_chain_whose_jobs_cannot_start_ends_after_two_and_a_new_chain_runs(tmp_path):
    config = _write_config(tiny_run_config(tmp_path), tmp_path / "run.toml", steps=8)
    file_list = tmp_path / "data" / "list.txt"
    file_list.rename(tmp_path / "list.txt.aside")  # the bug: the config names a missing file
    run_dir = tmp_path / "run"  # tiny_run_config's train.run_dir

    name = f"chain-{uuid.uuid4().hex[:8]}"
    jobs = _run_chain(tmp_path, run_dir, config, name=name, max_jobs=8, timeout_s=240)
    assert [state for _, state in jobs] == ["FAILED", "FAILED", "CANCELLED"]
    (first, _), (second, _), (third, _) = jobs
    records = [record.to_json() for record in read_attempts(run_dir / "attempts.jsonl")]
    assert [(r["job"], r["steps_gained"]) for r in records] == [(first, 0), (second, 0)]
    assert str(file_list) in _job_log(run_dir, first)  # the trainer's own error, in the log
    log = _job_log(run_dir, second)
    assert f"goodput chain: jobs {first} and {second}: 2 jobs in a row gained no step" in log
    assert f"goodput chain: job 2: job {third} cancelled" in log
    assert not list(run_dir.glob(f"chain-*-{third}.out"))  # cancelled before it started

    # Fixed, and submitted again as it was: a new chain, which trains to the end in one job.
    (tmp_path / "list.txt.aside").rename(file_list)
    jobs = _run_chain(tmp_path, run_dir, config, name=name, max_jobs=8, timeout_s=240)
    assert [state for _, state in jobs] == ["COMPLETED", "CANCELLED"]
    assert (run_dir / "done").exists()
    records = [record.to_json() for record in read_attempts(run_dir / "attempts.jsonl")]
    assert records[-1]["job"] == jobs[0][0] and records[-1]["steps_gained"] == 8


def _seconds_per_step(cfg: RunConfig, tmp_path: Path) -> float:
    """This machine's time per step of ``cfg``'s model on 2 local ranks, now."""
    run_dir = tmp_path / "calibration"
    config = _write_config(cfg, tmp_path / "calibration.toml", steps=16, run_dir=str(run_dir))
    argv = ["goodput", "launch", "--nproc", "2", "--", "goodput", "train", str(config)]
    result = subprocess.run(
        argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    times = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").open()]
    return statistics.median(b - a for a, b in zip(times[4:], times[5:], strict=False))


@pytest.mark.timeout(900)
def test_a_two_rank_training_chain_finishes_across_walltime_kills(tmp_path):
    cfg = tiny_run_config(tmp_path)
    steps = max(200, round(TRAIN_S / _seconds_per_step(cfg, tmp_path)))
    config = _write_config(cfg, tmp_path / "run.toml", steps=steps)
    run_dir = Path(cfg.train.run_dir)

    name = f"chain-{uuid.uuid4().hex[:8]}"
    jobs = _run_chain(tmp_path, run_dir, config, name=name, max_jobs=6, timeout_s=720)
    states = [state for _, state in jobs]
    # Every job but the last that ran hit the walltime; the last wrote done and cancelled its
    # queued successor, if it had one.
    last = max(i for i, state in enumerate(states) if state != "CANCELLED")
    assert last >= 1, f"one job finished {steps} steps: raise TRAIN_S ({states})"
    # Slurm enforces time limits every 30 s, so the job that wrote done as its minute ran out may
    # still read TIMEOUT; done, its log and its attempt record below say it finished the run.
    assert states[:last] == ["TIMEOUT"] * last and states[last] in ("COMPLETED", "TIMEOUT")
    assert "the run is complete" in _job_log(run_dir, jobs[last][0])
    assert states[last + 1 :] in ([], ["CANCELLED"])
    assert (run_dir / "done").exists()

    records = [record.to_json() for record in read_attempts(run_dir / "attempts.jsonl")]
    assert [r["job"] for r in records] == [job for job, _ in jobs[: last + 1]]
    assert [(r["class"], r["exit_code"]) for r in records] == [("walltime", 143)] * last + [
        ("success", 0)
    ]
    assert all(r["steps_gained"] > 0 for r in records)
    for (job, _), (next_job, _) in zip(jobs[:last], jobs[1 : last + 1], strict=True):
        log = _job_log(run_dir, job)
        stopped = int(log.split("terminated by SIGTERM after step ")[1].split(";")[0])
        assert "(written synchronously)" in log
        assert "the launch exited 143; job " in log
        assert f"resume: from {run_dir}/checkpoints/step-{stopped:08d}" in _job_log(
            run_dir, next_job
        )
    assert "done written, the run is complete" in _job_log(run_dir, jobs[last][0])
    # Each step ran once across the jobs: every resume began right after the save.
    metrics = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert metrics == list(range(1, steps + 1))
