"""``goodput.launch.run``, the Python API behind ``goodput launch``, called in this process on
real local ranks (the CLI's own tests go through ``goodput launch``)."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

import goodput.launch
from goodput.errors import ExitCode
from goodput.launch import LaunchOptions
from goodput.launch.history import read_attempts
from goodput.testing.jobs import JOB_PREFIXES, JOB_VARS

# Fails on its first run, then trains three steps.
FLAKY = """
    import pathlib, sys
    marker = pathlib.Path("ran-once")
    if not marker.exists():
        marker.write_text("")
        sys.exit(5)
    for step in (1, 2, 3):
        print(f"step={step}", flush=True)
"""

# Keeps a heartbeat where goodput launch asks (as goodput train does) but prints no step line,
# as when a wrapper sends the trainer's output elsewhere; its first run dies by SIGKILL.
QUIET = """
    import json, os, pathlib, signal, time
    heartbeat = pathlib.Path(os.environ["GOODPUT_HEARTBEAT"])
    for step in (1, 2, 3):
        heartbeat.write_text(json.dumps({"step": step, "time": time.time()}))
    if not pathlib.Path("ran-once").exists():
        pathlib.Path("ran-once").write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(autouse=True)
def outside_a_job(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith(JOB_PREFIXES) or name in JOB_VARS:
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def test_run_retries_and_logs_each_attempt(tmp_path, capsys):
    (tmp_path / "flaky.py").write_text(textwrap.dedent(FLAKY))
    options = LaunchOptions(
        command=(sys.executable, "flaky.py"),
        nproc=1,
        retries=1,
        backoff_s=0.1,
        run_dir=tmp_path / "run",
    )
    assert goodput.launch.run(options) == ExitCode.OK
    first, second = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert (first.class_, first.exit_code, first.decision) == ("stuck-pre-training", 5, "retry")
    assert (second.class_, second.steps_gained, second.reason) == ("success", 3, "done")
    assert first.of == second.of == 2 and first.job is None and first.hosts == ("localhost",)
    assert first.first_step_at is None
    assert second.started < second.first_step_at < second.ended
    err = capsys.readouterr().err
    assert "launch: attempt 1 of 2 exited 5 (error) after " in err


def test_a_death_by_signal_exits_1_and_the_log_keeps_the_signal(tmp_path):
    kill = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    options = LaunchOptions(command=(sys.executable, "-c", kill), run_dir=tmp_path / "run")
    assert goodput.launch.run(options) == ExitCode.ERROR
    (line,) = (tmp_path / "run" / "attempts.jsonl").read_text().splitlines()
    assert json.loads(line)["exit_code"] == 137


def test_progress_is_seen_by_the_heartbeat_when_no_step_line_comes(tmp_path):
    (tmp_path / "quiet.py").write_text(textwrap.dedent(QUIET))
    run_dir = tmp_path / "launch-run"
    options = LaunchOptions(
        command=(sys.executable, "quiet.py"), retries=1, backoff_s=30.0, run_dir=run_dir
    )
    assert goodput.launch.run(options) == ExitCode.OK
    first, second = read_attempts(run_dir / "attempts.jsonl")
    assert (first.exit_code, first.steps_seen, first.steps_gained) == (137, 0, 3)
    assert first.class_ == "error"  # not stuck: it stepped
    assert first.wait_s is not None and first.wait_s <= 1.0  # progress: no backoff
    assert json.loads((run_dir / "heartbeat").read_text())["step"] == 3


# Trains three steps, then hangs silently in its teardown, as a process group's destroy can; with
# a last beat that says done (as goodput train writes once `done` is) when "done" is its argument.
LINGERS = """
    import json, os, pathlib, sys, time
    heartbeat = pathlib.Path(os.environ["GOODPUT_HEARTBEAT"])
    for step in (1, 2, 3):
        print(f"step={step}", flush=True)
        heartbeat.write_text(json.dumps({"step": step, "time": time.time()}))
    if sys.argv[1:] == ["done"]:
        heartbeat.write_text(json.dumps({"step": 3, "time": time.time(), "done": True}))
    time.sleep(600)
"""


@pytest.mark.parametrize("done", [True, False])
def test_a_run_that_said_done_and_then_hangs_is_a_success_not_retried(tmp_path, capsys, done):
    (tmp_path / "lingers.py").write_text(textwrap.dedent(LINGERS))
    run_dir = tmp_path / "run"
    options = LaunchOptions(
        command=(sys.executable, "lingers.py", *(["done"] if done else [])),
        auto_retry=True,
        retries=1,
        idle_timeout_s=1.5,
        backoff_s=0.1,
        grace_s=0.5,
        run_dir=run_dir,
    )
    code = goodput.launch.run(options)
    attempts = read_attempts(run_dir / "attempts.jsonl")
    err = capsys.readouterr().err
    if done:  # the watchdog stopped it, and the run was complete: one attempt, exit 0
        assert code == ExitCode.OK and len(attempts) == 1
        (only,) = attempts
        assert (only.class_, only.exit_code, only.timed_out) == ("success", 124, True)
        assert only.steps_gained == 3
        assert (
            "launch: the run is complete (its last heartbeat says done), but its processes "
            "ended with exit 124: not retried"
        ) in err
    else:  # the control: the same hang before done is a hang, retried
        assert code == ExitCode.IDLE_TIMEOUT
        assert [a.class_ for a in attempts] == ["hang", "hang"]
        assert "not retried" not in err
