"""``goodput launch``'s recovery policy on real runs: local gloo ranks and real ``goodput train``
ranks that the test SIGKILLs mid-run, through the real CLI.

A rank killed on the only host is a process gone, not a bad host: its peer's "Connection closed
by peer" names the host, whose health probe passes, so the run goes on there and finishes. After
an attempt that made progress the next one starts within a second, whatever ``--backoff`` says;
the trainer's heartbeat shows that progress even when no step line reaches the launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

from goodput import rundir
from goodput.config import to_toml
from goodput.launch.history import read_attempts
from goodput.launch.retry import PROGRESS_WAIT_S
from goodput.testing.jobs import launched_rank_pids, outside_any_job
from goodput.testing.tiny import tiny_run_config

TIMEOUT_S = 300

# Two gloo ranks all-reducing a step counter, rank 0 printing each step. On the first run rank 1
# SIGKILLs itself at step 3; rank 0 ignores SIGTERM, so that what gloo says about its peer is
# printed before the launcher's teardown could stop it.
GLOO_WORKER = """
    import os, pathlib, signal, time
    import torch, torch.distributed as dist
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.init_process_group("gloo")
    rank, first_run = dist.get_rank(), not pathlib.Path("ran-once").exists()
    dist.barrier()
    if rank == 0:
        pathlib.Path("ran-once").write_text("")
    for step in range(1, 7):
        if first_run and rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        total = torch.tensor([step])
        dist.all_reduce(total)
        if rank == 0:
            print(f"step={step}", flush=True)
        time.sleep(0.1)
    dist.destroy_process_group()
"""


def _launch(*args: str, cwd: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "goodput", "launch", "--nproc", "2", "--grace", "5", *args]
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=outside_any_job(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill_rank_at_steps(
    launcher: subprocess.Popen[str], heartbeat: Path, steps: list[int]
) -> list[int]:
    """SIGKILL rank 1 once the trainer's heartbeat reaches each of ``steps``, one process per
    step (a new attempt runs a new one); the steps the heartbeat named at each kill."""
    killed: list[int] = []
    pids: set[int] = set()
    deadline = time.monotonic() + TIMEOUT_S
    while len(killed) < len(steps) and launcher.poll() is None and time.monotonic() < deadline:
        try:
            step = json.loads(heartbeat.read_text())["step"]
        except (OSError, ValueError):
            step = 0
        pid = launched_rank_pids(launcher.pid).get(1) if step >= steps[len(killed)] else None
        if pid is not None and pid not in pids:
            os.kill(pid, signal.SIGKILL)
            pids.add(pid)
            killed.append(step)
        time.sleep(0.02)
    return killed


def _train_config(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny 2-rank run of 30 steps saving every 5; (its config file, its run directory)."""
    cfg = tiny_run_config(tmp_path)
    cfg = replace(
        cfg,
        train=replace(cfg.train, steps=30),
        checkpoint=replace(cfg.checkpoint, interval_steps=5),
    )
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    return path, Path(cfg.train.run_dir)


def test_a_local_rank_killed_is_retried_on_the_same_host_after_its_probe(tmp_path):
    (tmp_path / "worker.py").write_text(textwrap.dedent(GLOO_WORKER))
    run_dir = tmp_path / "launch"
    launcher = _launch(
        "--auto-retry", "--run-dir", str(run_dir), "--", sys.executable, "worker.py", cwd=tmp_path
    )
    out, err = launcher.communicate(timeout=TIMEOUT_S)
    assert launcher.returncode == 0, err
    first, second = [r.to_json() for r in read_attempts(run_dir / "attempts.jsonl")]
    assert first["exit_code"] == 137 and first["class"] == "error"
    assert first["hosts"] == second["hosts"] == ["localhost"]
    assert first["evidence"] == [] and first["replaced"] == {} and first["decision"] == "retry"
    assert first["wait_s"] <= PROGRESS_WAIT_S  # steps 1 and 2 were progress
    assert second["class"] == "success" and second["steps_gained"] == 6
    assert "by peer" in out  # gloo's word on the dead rank, from rank 0
    assert "probing 1 host(s)" in err and "no spare" not in err
    (kept,) = [line for line in err.splitlines() if "health probe passed" in line]
    assert kept.startswith("launch:   localhost: ") and "by peer" in kept


def test_goodput_train_with_a_rank_killed_finishes_on_the_same_host(tmp_path):
    config, train_dir = _train_config(tmp_path)
    launcher = _launch(
        "--auto-retry",
        "--run-dir",
        str(train_dir),
        "--",
        sys.executable,
        "-m",
        "goodput",
        "train",
        str(config),
        cwd=tmp_path,
    )
    killed = _kill_rank_at_steps(launcher, train_dir / rundir.HEARTBEAT, [3])
    _, err = launcher.communicate(timeout=TIMEOUT_S)
    assert len(killed) == 1 and launcher.returncode == 0, err
    first, second = read_attempts(train_dir / rundir.ATTEMPTS)
    assert first.exit_code == 137 and first.decision == "retry" and first.replaced == {}
    assert first.hosts == second.hosts == ("localhost",) and first.steps_gained >= 3
    assert first.wait_s is not None and first.wait_s <= PROGRESS_WAIT_S
    assert second.class_ == "success" and second.last_step == 30
    assert (train_dir / rundir.DONE).exists()


def test_progress_unseen_in_the_output_still_restarts_within_a_second(tmp_path):
    # The trainer's output goes to a file (as a wrapper script might send it), and its run
    # directory is not the launcher's: the launcher sees progress through the heartbeat that
    # goodput train keeps where the launcher asked. --backoff 30 would wait 15-30 s.
    config, train_dir = _train_config(tmp_path)
    quiet = (
        "import os, sys; out = os.open('train.log', os.O_WRONLY | os.O_CREAT | os.O_APPEND);"
        " os.dup2(out, 1); os.dup2(out, 2);"
        " os.execv(sys.executable, [sys.executable, '-m', 'goodput', 'train', sys.argv[1]])"
    )
    launch_dir = tmp_path / "launch"
    launcher = _launch(
        "--retries",
        "3",
        "--backoff",
        "30",
        "--run-dir",
        str(launch_dir),
        "--",
        sys.executable,
        "-c",
        quiet,
        str(config),
        cwd=tmp_path,
    )
    killed = _kill_rank_at_steps(launcher, train_dir / rundir.HEARTBEAT, [3, 12])
    out, err = launcher.communicate(timeout=TIMEOUT_S)
    assert len(killed) == 2 and launcher.returncode == 0, err
    assert "step=" not in out  # no step line reached the launcher
    records = read_attempts(launch_dir / rundir.ATTEMPTS)
    assert [r.exit_code for r in records] == [137, 137, 0]
    assert all(r.steps_seen == 0 and r.steps_gained >= 1 for r in records)
    waits = [r.wait_s for r in records[:2]]
    assert all(wait is not None and wait <= PROGRESS_WAIT_S for wait in waits), waits
    assert json.loads((launch_dir / rundir.HEARTBEAT).read_text())["step"] == 30
    assert (train_dir / rundir.DONE).exists()
