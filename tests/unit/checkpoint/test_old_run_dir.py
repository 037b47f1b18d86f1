"""A run directory and checkpoints written by an older goodput (``tests/fixtures/run-9acd2c9``,
main before the train/ wings and the snapshot package) still list, report and resume with
today's code, and the resume continues the old straight run's losses."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from goodput.testing.jobs import REPO, run_goodput

FIXTURE = REPO / "tests" / "fixtures" / "run-9acd2c9"


def _copy(tmp_path: Path) -> Path:
    run = tmp_path / "old"
    shutil.copytree(FIXTURE, run)
    return run


def test_an_old_run_is_listed_and_reported(tmp_path):
    old = _copy(tmp_path)
    listed = run_goodput("ckpt", "list", old / "run", "--json")
    assert listed.returncode == 0, listed.stderr
    steps = [entry["step"] for entry in json.loads(listed.stdout)["checkpoints"]]
    assert sorted(steps) == [2, 4, 6]
    report = run_goodput("report", old / "run", "--json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["steps"]["last"] == 6


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def test_an_old_checkpoint_resumes_to_the_old_runs_losses(tmp_path):
    old = _copy(tmp_path)
    result = run_goodput(
        "train", "config.toml", "train.run_dir=resumed",
        "checkpoint.resume=run/checkpoints/step-00000004", cwd=old, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected = _losses(old / "run")
    resumed = _losses(old / "resumed")
    assert sorted(resumed) == [5, 6]
    for step, loss in resumed.items():
        # fp32 on one CPU: the same sums in the same order; float32 rounding as the margin.
        assert math.isclose(loss, expected[step], rel_tol=1e-6), (step, loss)
