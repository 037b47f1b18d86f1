"""``goodput chaos`` through the real CLI on 2 CPU ranks of the tiny config: real ranks that really
die by SIGKILL (after a step, during a checkpoint flush), really stop (SIGSTOP: the watchdog
ends the attempt), a save that really fails and a NaN really injected into the gradients — and a
campaign whose faulted run is deliberately different, which must fail naming the first
difference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from goodput import cli, rundir
from goodput.config import to_toml
from goodput.launch.history import read_attempts
from goodput.testing.jobs import JOB_PREFIXES, JOB_VARS, outside_any_job
from goodput.testing.tiny import tiny_run_config

ENDS_ATTEMPT = {"kill", "ckpt-kill", "hang"}
# A stopped rank is past SIGTERM's reach: a short grace keeps each hang from costing 10 s more.
# Steps print every few hundredths of a second: a 3 s watchdog finds the hang, where the one
# chaos derives would wait at least 10 s (that one is checked on the walkthrough's campaign,
# tests/e2e/test_demo_pipeline.py); start-up, silent for seconds, gets its own bound.
LAUNCH_OPTIONS = ["--", "--grace", "1", "--timeout", "3", "--startup-timeout", "30"]


def write_config(tmp_path: Path, steps: int) -> Path:
    cfg = tiny_run_config(tmp_path)
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(replace(cfg, train=replace(cfg.train, steps=steps))))
    return config


def goodput_chaos(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "goodput", "chaos", *args]
    return subprocess.run(argv, env=outside_any_job(), capture_output=True, text=True, timeout=900)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / rundir.METRICS).read_text().splitlines()]


@pytest.mark.timeout(900)
def test_seeded_faults_of_every_local_kind_end_bitwise_equal(tmp_path, capsys):
    config, out = write_config(tmp_path, steps=30), tmp_path / "campaign"
    kinds = "kill,ckpt-kill,hang,save-fail,nan"
    result = goodput_chaos(
        str(config), "--faults", "5", "--kinds", kinds, "--nproc", "2", "--output", str(out),
        *LAUNCH_OPTIONS,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "final state against the straight run: bitwise equal" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["comparison"]["equal"]
    faults = {fault["kind"]: fault for fault in report["faults"]}
    assert sorted(faults) == sorted(kinds.split(","))  # one of each, as dealt
    assert "checkpoint.interval_steps=3 for both runs" in report["notes"][0]  # tiny saves never

    # Each fault is a row of the table, with the step it fired at.
    for fault in report["faults"]:
        assert fault["fired_step"] == fault["step"]  # save faults sit on a save step
        row = f"  {fault['id']}   {fault['kind']}"
        assert any(line.startswith(row) for line in result.stdout.splitlines()), row

    # Each fault that ended an attempt: that attempt's class, detection, loss and recovery.
    attempts = read_attempts(out / "faulted" / rundir.ATTEMPTS)
    for kind in ENDS_ATTEMPT:
        fault = faults[kind]
        ended, back = attempts[fault["attempt"] - 1], attempts[fault["attempt"]]
        assert (ended.class_, ended.exit_code) == (
            ("hang", 124) if kind == "hang" else ("error", 137)
        )
        assert fault["steps_lost"] == ended.last_step - (back.first_step - 1) >= 0
        assert 0 < fault["detection_s"] < fault["recovery_s"]
        parts = ("detection_s", "backoff_s", "startup_s", "load_s", "first_step_s")
        assert sum(fault[part] for part in parts) <= fault["recovery_s"] + 0.1
    assert faults["hang"]["detection_s"] >= report["idle_timeout_s"]

    # The failed save was reported and training went on; the NaN step was skipped in both runs.
    log = (out / "faulted" / "launch.log").read_text()
    assert f"step-{faults['save-fail']['step']:08d} FAILED on rank(s)" in log
    nan_step = faults["nan"]["step"]
    for run in ("reference", "faulted"):
        skipped = {record["step"] for record in metrics(out / run) if record["skipped"]}
        assert skipped == {nan_step}, run
    assert (out / "reference-fired" / f"{faults['nan']['id']}.json").is_file()

    # Goodput is goodput report's, for each run: the same account, whose causes and productive
    # time cover the whole wall time.
    for run, name in (("faulted", "faulted"), ("reference", "straight")):
        assert report["goodput"][name] == report_json(out / run, capsys), run
    goodput = report["goodput"]["faulted"]
    total = goodput["productive_s"] + sum(goodput["badput_s"].values())
    assert total == pytest.approx(goodput["wall_s"])
    # Both are fractions of their run's wall time; which is larger is timing, not behaviour (on
    # a 30-step run the straight run's cold start can cost more than the faults do).
    assert 0 < goodput["goodput"] <= 1 and 0 < report["goodput"]["straight"]["goodput"] <= 1
    assert goodput["badput_s"]["recomputed"] > 0 and goodput["badput_s"]["hang"] > 0
    assert goodput["steps"]["recomputed"] > 0 and goodput["steps"]["kept"] == 30
    assert "badput by cause, as goodput report counts it: " in result.stdout


def report_json(run_dir: Path, capsys) -> dict:
    """``goodput report RUN --json``, as a person runs it."""
    capsys.readouterr()
    assert cli.main(["report", str(run_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.timeout(900)
def test_a_faulted_run_that_differs_fails_naming_the_first_difference(tmp_path):
    config, out = write_config(tmp_path, steps=12), tmp_path / "campaign"
    # The control: another weight decay in the faulted run only. Step 1 runs from the same
    # weights, so the first loss to differ is step 2's.
    result = goodput_chaos(
        str(config), "--faults", "1", "--kinds", "kill", "--nproc", "2", "--output", str(out),
        "--perturb", "optim.weight_decay=0.5", *LAUNCH_OPTIONS,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED: final state against the straight run: DIFFERENT" in result.stdout
    assert "  losses: step 2: " in result.stdout
    report = json.loads((out / "report.json").read_text())
    comparison = report["comparison"]
    assert not report["passed"] and comparison["first_difference"].startswith("losses: step 2: ")
    assert comparison["weights"].startswith("model.")
    assert comparison["optimizer"] is not None
    assert report["faults"][0]["fired_step"] is not None  # the fault did fire


@pytest.fixture
def outside_a_job(monkeypatch):
    """For the tests that run goodput in this process: no job's placement or profile."""
    for name in list(os.environ):
        if name.startswith(JOB_PREFIXES) or name in JOB_VARS:
            monkeypatch.delenv(name)


def test_a_folder_goodput_did_not_make_is_refused_and_left_alone(tmp_path, capsys, outside_a_job):
    config, out = write_config(tmp_path, steps=12), tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert exit_code(["chaos", str(config), "--nproc", "2", "--output", str(out)]) == 2
    assert "is not a folder that holds campaign.json" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--faults", "2", "--kinds", "kill,bad-node"], "1 bad-node fault(s) need as many spare"),
        (["--", "--run-dir", "x"], "goodput chaos -- --run-dir: is the campaign's to set"),
        (["--", "python", "train.py"], "is not a launch option here"),
        (["--kinds", "kill,oops"], "'oops' is not a fault kind"),
        (["--kinds", "kill", "--faults", "40"], "40 faults at distinct steps need more than 12"),
        (["--perturb", "train.stepz=3"], "stepz"),  # a mistyped control, before any run
    ],
)
def test_what_cannot_run_is_refused_before_anything_runs(
    tmp_path, capsys, outside_a_job, args, said
):
    config, out = write_config(tmp_path, steps=12), tmp_path / "campaign"
    assert exit_code(["chaos", str(config), "--nproc", "2", "--output", str(out), *args]) == 2
    assert said in capsys.readouterr().err
    assert not out.exists()


def exit_code(argv: list[str]) -> int | str | None:
    """``goodput ARGV`` in this process; argparse's own refusals exit instead of returning."""
    try:
        return cli.main(argv)
    except SystemExit as exit_:
        return exit_.code
