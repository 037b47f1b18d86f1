"""A fault plan entry that could never fire — a rank beyond the world, a step beyond the run, a
save fault in a run that never saves — is refused at start, naming the entry, before any work:
never accepted to end in exit 0 with the fault untried."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from goodput.config import to_toml
from goodput.errors import ExitCode, GoodputError
from goodput.faults import FaultPlan, parse_plan
from goodput.testing.tiny import tiny_run_config

TIMEOUT_S = 240


def plan_of(tmp_path: Path, *faults: tuple[int, str, int, int]) -> Path:
    entries = [dict(zip(("id", "kind", "step", "rank"), fault, strict=True)) for fault in faults]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"fired_dir": str(tmp_path / "fired"), "faults": entries}))
    return path


@pytest.mark.parametrize(
    ("faults", "saves", "message"),
    [
        (
            [(0, "kill", 3, 0), (5, "kill", 4, 2)],
            True,
            "faults[1] (id 5, kill): rank 2 is not below the world size 2",
        ),
        (
            [(9, "nan", 9, 1)],
            True,
            "faults[0] (id 9, nan): step 9 is after the run's last (train.steps = 8)",
        ),
        (
            [(1, "ckpt-kill", 3, 0)],
            False,
            "faults[0] (id 1, ckpt-kill): the run saves no checkpoints",
        ),
    ],
)
def test_an_entry_that_could_never_fire_is_named(tmp_path, faults, saves, message):
    plan_file = plan_of(tmp_path, *faults)
    parsed, fired_dir = parse_plan(json.loads(plan_file.read_text()))
    plan = FaultPlan(parsed, fired_dir, {"GOODPUT_FAULTS": str(plan_file)})
    with pytest.raises(GoodputError) as error:
        plan.check_reachable(world_size=2, steps=8, saves=saves, snapshots=True)
    assert message in error.value.render() and "would never fire" in error.value.render()
    assert str(plan_file) in error.value.render() and error.value.code == ExitCode.USAGE


def test_entries_that_can_fire_pass(tmp_path):
    plan_file = plan_of(tmp_path, (0, "kill", 8, 1), (1, "save-fail", 1, 0))
    parsed, fired_dir = parse_plan(json.loads(plan_file.read_text()))
    reachable = FaultPlan(parsed, fired_dir, {})
    reachable.check_reachable(world_size=2, steps=8, saves=True, snapshots=False)


@pytest.mark.parametrize(
    ("fault", "named"),
    [((3, "kill", 2, 1), "rank 1 is not below the world size 1"), ((4, "hang", 9, 0), "step 9")],
)
def test_goodput_train_refuses_the_plan_before_training(tmp_path, fault, named):
    cfg = tiny_run_config(tmp_path)  # 8 steps, one rank
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, interval_steps=2))
    config = tmp_path / "run.toml"
    config.write_text(to_toml(cfg))
    plan = plan_of(tmp_path, fault)
    run = subprocess.run(
        [sys.executable, "-m", "goodput", "train", str(config)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "GOODPUT_FAULTS": str(plan), "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == ExitCode.USAGE, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"faults[0] (id {fault[0]}, {fault[1]})" in lines[0], run.stderr
    assert named in lines[0]
    assert "step=" not in run.stdout  # before training
    assert not Path(cfg.train.run_dir).exists() and not (tmp_path / "fired").exists()
