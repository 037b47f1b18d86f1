"""Real processes that really die: kill -9 while a checkpoint is being written, and the
scheduler's SIGTERM. The next start must resume from the newest complete checkpoint."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from goodput.config import to_toml
from goodput.rundir import checkpoints_dir, list_checkpoints
from goodput.testing.tiny import tiny_run_config


def write_config(tmp_path, **checkpoint):
    cfg = tiny_run_config(tmp_path)
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, **checkpoint))
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    return cfg, path


def goodput_train(config, *overrides):
    return subprocess.Popen(
        [sys.executable, "-m", "goodput", "train", str(config), *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# Wide enough that writing one checkpoint (~200 MB with AdamW state) takes a visible while; a
# save every step from step 1, so the kill lands in a flush within the first few steps, and the
# resume trains the rest (each step of this model costs a tenth of a second or more).
BIG = ["model.dim=512", "model.num_layers=4", "model.ffn_dim=2048", "train.steps=12"]


def test_kill_9_during_the_flush_leaves_a_checkpoint_the_next_start_skips(tmp_path):
    cfg, config = write_config(tmp_path, interval_steps=1, keep_last=2)
    root = checkpoints_dir(cfg.train.run_dir)
    for _attempt in range(5):  # the kill must land while a flush is running; retry if it did not
        process = goodput_train(config, *BIG)
        victim = None
        deadline = time.monotonic() + 120
        while victim is None and time.monotonic() < deadline and process.poll() is None:
            saved = list_checkpoints(root)
            writing = [c for c in saved if not c.complete and (c.path / "rng").exists()]
            if writing and any(c.complete for c in saved):
                os.kill(process.pid, signal.SIGKILL)
                victim = writing[-1]
            time.sleep(0.005)
        process.wait()
        if victim is not None and not (victim.path / ".complete").exists():
            break
    else:
        raise AssertionError("never caught a flush in progress")
    assert process.returncode == -signal.SIGKILL
    newest_complete = max(c.step for c in list_checkpoints(root) if c.complete)
    assert newest_complete < victim.step

    # Same run (same steps, so the same blend); saving only at the end now.
    resumed = goodput_train(config, *BIG, "checkpoint.interval_steps=1000")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert f"skipping checkpoint {victim.path}: incomplete" in out
    assert f"resume: from {root / f'step-{newest_complete:08d}'}" in out


# SIGTERM goes at step 3 and the trainer acts on it at the step it is in: the run is far from
# its end then, and the resume trains what is left of it.
SIGTERM_RUN_STEPS = 40


def test_sigterm_saves_and_exits_143_then_the_run_resumes(tmp_path):
    cfg, config = write_config(tmp_path, interval_steps=100)
    steps = f"train.steps={SIGTERM_RUN_STEPS}"
    process = goodput_train(config, steps)
    for line in process.stdout:
        if line.startswith("step=3 "):
            process.send_signal(signal.SIGTERM)
            break
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    stopped_at = int(err.split("terminated by SIGTERM after step ")[1].split(";")[0])
    root = checkpoints_dir(cfg.train.run_dir)
    assert [(c.step, c.complete) for c in list_checkpoints(root)] == [(stopped_at, True)]

    resumed = goodput_train(config, steps)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    ran = [int(line.split()[0][5:]) for line in out.splitlines() if line.startswith("step=")]
    assert ran == list(range(stopped_at + 1, SIGTERM_RUN_STEPS + 1))
    metrics = Path(cfg.train.run_dir, "metrics.jsonl").read_text()
    assert metrics.count("\n") == SIGTERM_RUN_STEPS
