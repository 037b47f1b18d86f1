"""``goodput diagnose smoke`` of a config of data-mix stages, some starting after the smoke's
last step: it keeps the stages that start in time, says so in a line, and records the run; the
check against that record passes. A decay tied to a stage it leaves out is refused, naming
the steps that would keep it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from goodput.config import to_toml
from goodput.diagnose.smoke import stage_overrides
from goodput.errors import GoodputError
from goodput.testing.jobs import outside_any_job
from goodput.testing.stages import staged_run_config
from goodput.train.config.schedule import ScheduleConfig

STEPS = 6  # the staged run's stages start after steps 0, 4 and 8


def smoke(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "goodput", "diagnose", "smoke", *map(str, args)],
        capture_output=True,
        text=True,
        env=outside_any_job(),
        timeout=240,
    )


def test_a_smoke_keeps_the_stages_that_start_before_its_end(tmp_path):
    config = tmp_path / "staged.toml"
    config.write_text(to_toml(staged_run_config(tmp_path)))
    record = tmp_path / "record.json"
    result = smoke(config, "--steps", STEPS, "--record", record)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    note = (
        f"smoke: {STEPS} steps keep the first 2 of the config's 3 data-mix stages; the others "
        "start after step 8 or later"
    )
    assert note in result.stdout
    assert len(json.loads(record.read_text())["steps"]) == STEPS
    checked = smoke(config, "--baseline", record)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    assert f"smoke: OK: {STEPS} steps match {record}" in checked.stdout


def test_a_decay_tied_to_a_stage_after_the_smokes_end_is_refused(tmp_path):
    cfg = staged_run_config(tmp_path)
    wsd = ScheduleConfig(kind="wsd", warmup_steps=2, decay_start="stage:2")
    config = tmp_path / "staged.toml"
    config.write_text(to_toml(replace(cfg, schedule=wsd)))
    with pytest.raises(GoodputError) as caught:
        stage_overrides(config, [], STEPS)
    assert caught.value.code == 2
    assert (
        "schedule.decay_start 'stage:2' names a stage that starts after the smoke's 6 steps: its "
        "run would differ from the config's; pass --steps above 8" in caught.value.render()
    )
