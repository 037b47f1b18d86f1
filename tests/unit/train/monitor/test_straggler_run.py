"""Real 2-rank runs with one rank slowed by an injected ``slow`` fault (``goodput.faults``, as
``goodput chaos`` injects it; a slow host cannot be summoned on one machine): docs/training.md's
command as written names that rank in exactly one straggler line, with the busy times in the
metrics and busy.jsonl; and with ``GOODPUT_EVICT_STRAGGLERS=1`` (which ``goodput launch`` gives
only under ``--auto-retry --evict-stragglers``; set here directly) every rank stops after the
next periodic save with exit code 4, that checkpoint complete."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from goodput import rundir
from goodput.errors import ExitCode, GoodputError
from goodput.ranks import EVICT_VAR, FAULTS_VAR
from goodput.runfiles import read_busy, read_steps
from goodput.stragglers_line import parse_notice
from goodput.testing.dist import run_distributed
from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO, outside_any_job
from goodput.testing.tiny import write_counting_corpus
from goodput.train.config.run import WatchConfig
from goodput.train.loop import train

SECTION = re.compile(r"^### Stragglers \(`\[watch\]`\)\n(.*?)(?=^##)", re.S | re.M)


def slow_plan(folder: Path, seconds: float) -> Path:
    """A fault plan slowing rank 1 by ``seconds`` on each of steps 1-10 (a 2-rank step of the
    CPU demo takes 0.1-1 s, as loaded as the machine is: 1 s more is a straggler either way)."""
    plan = folder / "faults.json"
    slow = {"id": 0, "kind": "slow", "step": 1, "rank": 1, "seconds": seconds, "steps": 10}
    plan.write_text(json.dumps({"fired_dir": str(folder / "fired"), "faults": [slow]}))
    return plan


def notices(output: str) -> list:
    """The straggler lines the ranks printed (not the launcher's evidence lines quoting them)."""
    lines = [line for line in output.splitlines() if not line.startswith("launch:")]
    return [parse_notice(line) for line in lines if "warning: straggler:" in line]


@pytest.mark.timeout(120)
def test_the_documented_command_names_the_slowed_rank_once(tmp_path):
    (section,) = SECTION.findall((REPO / "docs" / "training.md").read_text())
    (line,) = command_lines(section, ("sh",))
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    (tmp_path / "demo").mkdir()  # a counting corpus where tiny-cpu.toml reads the demo's data
    write_counting_corpus(tmp_path / "demo" / "counting")
    (tmp_path / "demo" / "file_list.txt").write_text("1.0 counting counting\n")
    env = outside_any_job(PATH=f"{Path(sys.executable).parent}:{outside_any_job()['PATH']}")
    env[FAULTS_VAR] = str(slow_plan(tmp_path, 1.0))
    result = subprocess.run(
        ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    found = notices(output)
    # One window judged: steps 2-3 (step 1 is each process's warm-up; step 4 starts a window
    # the run ends inside).
    assert len(found) == 1, output
    (notice,) = found
    assert notice.rank == 1 and (notice.first_step, notice.last_step) == (2, 3)
    assert notice.host == "localhost"  # the launcher's name, from its host file, not uname's
    assert notice.ratio > 1.2 and notice.busy_s >= 1.0 > notice.median_s / 2  # sleep is busy
    run_dir = tmp_path / "demo" / "run"
    steps = {line.step: line for line in read_steps(run_dir / rundir.METRICS)}
    assert sorted(steps) == list(range(1, 5))
    for step in steps.values():
        assert step.raw["busy_slowest_rank"] == 1 and step.raw["busy_slowest_host"] == notice.host
        assert step.number("busy_s_min") < step.number("busy_s_median") < step.number("busy_s_max")
        assert step.number("busy_s_max") >= 1.0
    named = {step for step, line in steps.items() if "straggler_rank" in line.raw}
    assert named == {notice.last_step} and steps[notice.last_step].raw["straggler_rank"] == 1
    windows = list(read_busy(run_dir / rundir.BUSY))
    assert [(w.step, w.steps, w.ranks) for w in windows] == [(3, 2, 2)]
    slowest = windows[0].slowest
    assert [(row.rank, row.host) for row in slowest] == [(1, notice.host), (0, notice.host)]
    assert slowest[0].mean_s == pytest.approx(notice.busy_s, abs=1e-3)


def train_until_stopped(rank, world_size, cfg):
    try:
        train(cfg)
    except GoodputError as error:
        return error.code, error.render()
    return ExitCode.OK, ""


def test_a_named_straggler_stops_every_rank_after_the_next_save(run_config, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULTS_VAR, str(slow_plan(tmp_path, 0.5)))
    monkeypatch.setenv(EVICT_VAR, "1")
    cfg = replace(
        run_config,
        checkpoint=replace(run_config.checkpoint, interval_steps=4),
        watch=WatchConfig(straggler_steps=2),
    )
    for code, line in run_distributed(train_until_stopped, 2, cfg):  # named at step 2
        assert code == ExitCode.STRAGGLER
        assert "stopping after the save of step 4 to replace straggler rank 1 on " in line
    run_dir = Path(cfg.train.run_dir)
    assert max(line.step for line in read_steps(run_dir / rundir.METRICS)) == 4
    assert (rundir.step_dir(run_dir / rundir.CHECKPOINTS, 4) / rundir.COMPLETE).exists()
    assert not (run_dir / rundir.DONE).exists()
