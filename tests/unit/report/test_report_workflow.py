"""The report of a real run trained by hand and then continued under the launcher on the same run
directory (`goodput train CONFIG`, then `goodput launch --run-dir RUN -- goodput train CONFIG`):
the hand process wrote no attempt record, and the report once put its steps outside the wall
time (goodput 550 %). Real processes, a tiny model, a few steps each."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from goodput.config import to_toml
from goodput.testing.jobs import outside_any_job
from goodput.testing.tiny import tiny_run_config

BIN = Path(sys.executable).parent  # the launcher finds this venv's goodput on PATH


def goodput(*args: str) -> str:
    env = outside_any_job(PATH=os.pathsep.join([str(BIN), os.environ["PATH"]]), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "goodput", *args], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_run_trained_by_hand_then_launched(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(tiny_run_config(tmp_path)))
    run_dir = tmp_path / "run"
    train = ["train", str(config), "checkpoint.interval_steps=3"]
    goodput(*train, "train.steps=6")
    goodput("launch", "--run-dir", str(run_dir), "--", "goodput", *train, "train.steps=12")
    report = json.loads(goodput("report", str(run_dir), "--json"))
    attempts = [(a["class"], a["first_step"], a["last_step"]) for a in report["attempts"]]
    assert attempts == [("unrecorded", 1, 6), ("success", 7, 12)]
    assert report["ignored"] == [] and report["steps"]["kept"] == 12
    assert 0 < report["goodput"] <= 1 and min(report["badput_s"].values()) >= 0
    total = report["productive_s"] + sum(report["badput_s"].values())
    assert total == pytest.approx(report["wall_s"], abs=1e-6)
    first, second = report["attempts"]
    assert report["start"] == first["started"] and report["end"] == second["ended"]
    assert report["badput_s"]["queue"] == pytest.approx(second["started"] - first["ended"])
