"""The attempt loop under plain ``--retries``: real attempts that fail, hang and then succeed."""

from __future__ import annotations

import io
import os
import random
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import pytest

from goodput.launch.attempt import AttemptResult, ProcessSpec, run_attempt
from goodput.launch.failover import Pool
from goodput.launch.history import read_attempts
from goodput.launch.retry import (
    PROGRESS_WAIT_S,
    Policy,
    describe_exit,
    restart_delay,
    run_attempts,
)

# Attempt n (counted in the file "count") behaves as OUTCOMES[n]: exit with that code, hang
# after printing (the watchdog ends it), or print steps and succeed.
FLAKY = """
    import pathlib, sys, time
    count = pathlib.Path(__file__).with_name("count")
    attempt = int(count.read_text()) if count.exists() else 0
    count.write_text(str(attempt + 1))
    outcome = {outcomes!r}[attempt]
    print(f"attempt {{attempt}}: {{outcome}}")
    if outcome == "hang":
        time.sleep(60)
    if outcome == "ok":
        print("step=1")
        print("step=2")
    sys.exit(0 if outcome == "ok" else outcome)
"""


def flaky(tmp_path: Path, *outcomes: int | str):
    script = tmp_path / "flaky.py"
    script.write_text(textwrap.dedent(FLAKY.format(outcomes=list(outcomes))))
    spec = ProcessSpec([sys.executable, "-u", str(script)], dict(os.environ), "0")
    started: list[int] = []

    def start_attempt(hosts, on_line) -> AttemptResult:
        assert hosts == ("localhost",)
        started.append(len(started))
        return run_attempt(
            [spec], idle_timeout_s=1.0, grace_s=1.0, out=io.BytesIO(), on_line=on_line
        )

    return start_attempt, started


def retry(start_attempt, retries: int, log: Path, **options) -> int:
    """Plain ``--retries``: the trivial policy, on one host with no spare."""
    backoff = {"backoff_s": options.pop("backoff_s")} if "backoff_s" in options else {}
    policy = Policy(max_attempts=retries + 1, **backoff)
    return run_attempts(start_attempt, policy, Pool(["localhost"], []), attempts_log=log, **options)


def read_log(path: Path) -> list[dict]:
    return [record.to_json() for record in read_attempts(path)]  # strictly, as a report reads


def test_fails_twice_then_succeeds(tmp_path, capsys):
    start_attempt, started = flaky(tmp_path, 1, "hang", "ok")
    sleeps: list[float] = []
    log = tmp_path / "run" / "attempts.jsonl"
    code = retry(start_attempt, 3, log, backoff_s=2.0, rng=random.Random(0), sleep=sleeps.append)
    assert code == 0
    assert started == [0, 1, 2]
    records = read_log(log)
    assert [r["attempt"] for r in records] == [1, 2, 3]
    assert [r["exit_code"] for r in records] == [1, 124, 0]
    assert [r["timed_out"] for r in records] == [False, True, False]
    assert [(r["steps_seen"], r["last_step"]) for r in records] == [(0, None), (0, None), (2, 2)]
    assert [r["class"] for r in records] == ["stuck-pre-training", "hang", "success"]
    assert [r["decision"] for r in records] == ["retry", "retry", "stop"]
    assert [r["wait_s"] for r in records] == [*sleeps, None]
    for record in records:
        assert record["of"] == 4 and record["hosts"] == ["localhost"] and record["replaced"] == {}
        assert datetime.fromisoformat(record["started"]) <= datetime.fromisoformat(record["ended"])
    first_step_at = datetime.fromisoformat(records[2]["first_step_at"])
    assert records[2]["started"] <= records[2]["first_step_at"] <= records[2]["ended"]
    assert first_step_at.utcoffset() is not None and records[0]["first_step_at"] is None
    assert len(sleeps) == 2
    assert 1.0 <= sleeps[0] <= 2.0 and 2.0 <= sleeps[1] <= 4.0  # doubling, jittered ×[0.5, 1]
    messages = capsys.readouterr().err.splitlines()
    retries = [line for line in messages if "retrying in" in line]
    assert retries[0].startswith("launch: attempt 1 of 4 exited 1 (error) after ")
    assert retries[1].startswith("launch: attempt 2 of 4 exited 124 (idle watchdog) after ")
    assert retries[1].endswith(f"; retrying in {sleeps[1]:.1f} s")


def test_exhausted_retries_return_the_last_code(tmp_path, capsys):
    start_attempt, started = flaky(tmp_path, 5, 5, 6)  # codes goodput gives no meaning
    sleeps: list[float] = []
    log = tmp_path / "attempts.jsonl"
    code = retry(start_attempt, 2, log, backoff_s=1.0, sleep=sleeps.append)
    assert code == 6
    assert started == [0, 1, 2]
    assert [r["exit_code"] for r in read_log(log)] == [5, 5, 6]
    assert len(sleeps) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("launch: attempt 3 of 3 exited 6 (error) after ")
    assert last.endswith("; no retries left")


@pytest.mark.parametrize(
    ("code", "kind"),
    [(130, "interrupted"), (143, "walltime"), (2, "stuck-pre-training"), (3, "stuck-pre-training")],
)
def test_interrupts_terminations_usage_errors_and_gate_stops_are_not_retried(code, kind, tmp_path):
    attempts: list[tuple[str, ...]] = []

    def start_attempt(hosts, on_line) -> AttemptResult:
        attempts.append(hosts)
        return AttemptResult(code, 0.1, False, "0", 0, None, None, [])

    sleeps: list[float] = []
    log = tmp_path / "attempts.jsonl"
    final = retry(start_attempt, 5, log, sleep=sleeps.append)
    assert (final, len(attempts), sleeps) == (code, 1, [])
    (record,) = read_log(log)
    assert record["class"] == kind and record["decision"] == "stop" and record["reason"]


def test_ctrl_c_during_the_backoff_returns_130(tmp_path):
    def start_attempt(hosts, on_line) -> AttemptResult:
        return AttemptResult(1, 0.1, False, "0", 0, None, None, [])

    def interrupted_sleep(seconds: float) -> None:
        raise KeyboardInterrupt

    assert retry(start_attempt, 3, tmp_path / "attempts.jsonl", sleep=interrupted_sleep) == 130


def test_backoff_doubles_up_to_the_cap_with_jitter():
    rng = random.Random(1)
    for without_progress, ceiling in [(1, 5.0), (2, 10.0), (4, 40.0), (7, 300.0), (10**6, 300.0)]:
        delay = restart_delay(without_progress, 5.0, 300.0, rng)
        assert ceiling / 2 <= delay <= ceiling


def test_after_progress_the_wait_is_at_most_a_second_whatever_the_backoff():
    rng = random.Random(2)
    for backoff_s in (0.0, 0.4, 5.0, 300.0):
        ceiling = min(backoff_s, PROGRESS_WAIT_S)
        assert all(ceiling / 2 <= restart_delay(0, backoff_s, 300.0, rng) <= ceiling for _ in "abc")


def test_attempts_that_keep_making_progress_restart_at_once(tmp_path):
    # Each attempt trains further than the last, then dies: what a node fault does to a run.
    script = tmp_path / "further.py"
    script.write_text(
        textwrap.dedent("""
            import pathlib
            count = pathlib.Path(__file__).with_name("count")
            attempt = int(count.read_text()) if count.exists() else 0
            count.write_text(str(attempt + 1))
            for step in range(1, 3 + 2 * attempt):
                print(f"step={step}", flush=True)
            raise SystemExit(0 if attempt == 3 else 137)
        """)
    )
    spec = ProcessSpec([sys.executable, str(script)], dict(os.environ), "0")
    sleeps: list[float] = []
    code = retry(
        lambda hosts, on_line: run_attempt([spec], idle_timeout_s=30, out=io.BytesIO()),
        5,
        tmp_path / "attempts.jsonl",
        backoff_s=30.0,
        sleep=sleeps.append,
    )
    assert code == 0 and len(sleeps) == 3
    assert all(0.5 <= wait <= PROGRESS_WAIT_S for wait in sleeps)
    records = read_log(tmp_path / "attempts.jsonl")
    assert [r["last_step"] for r in records] == [2, 4, 6, 8]
    assert [r["wait_s"] for r in records] == [*sleeps, None]


def test_exit_codes_are_described():
    assert describe_exit(124) == "idle watchdog"
    assert describe_exit(137) == "killed by SIGKILL"
    assert describe_exit(143) == "terminated"
    assert describe_exit(5) == "error"
