"""``goodput chaos --kinds slow,stall`` through the real CLI, as a user runs it, on 2 and on 4 CPU
ranks of the tiny config: real ranks that really sleep on each step of a window (a straggler)
or really block for ever in the data phase or before the step's first collective (a stall,
alive), a real launcher whose watchdog ends each stalled attempt and whose forensics read the
beacons and stacks, and the trainer's straggler watch. Every fault must be named, rank and host,
and the final state must be bitwise equal to the straight run's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from goodput import rundir
from goodput.config import to_toml
from goodput.launch.history import read_attempts
from goodput.testing.jobs import outside_any_job
from goodput.testing.tiny import tiny_run_config

# 2 windows of 10 steps (straggler_steps 5 + 5), 9 steps apart at least, and 2 stalls (one in
# the data phase, one before a collective: dealt evenly): room to draw
STEPS = 50
# Between steps the ranks print every few hundredths of a second: a 3 s watchdog finds a stall
# fast. Start-up is silent far longer (imports, the process group: 8 s and more with 4 ranks on
# 2 busy cores), so it gets its own bound until the first step line. A stalled rank's peers wait
# in a collective and never act on SIGTERM: a short grace.
LAUNCH_OPTIONS = ["--", "--timeout", "3", "--startup-timeout", "30", "--grace", "1"]


def write_config(tmp_path: Path) -> Path:
    cfg = tiny_run_config(tmp_path)
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(replace(cfg, train=replace(cfg.train, steps=STEPS))))
    return config


@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc", [2, 4])
def test_every_slow_and_stalled_rank_is_named_and_the_state_is_bitwise_equal(tmp_path, nproc):
    config, out = write_config(tmp_path), tmp_path / "campaign"
    # The watch at 1.5x, not its default 1.2x: 4 ranks on 2 busy cores drift past 1.2x by noise
    # alone (seen: 1.26x for a rank the window before its fault's, which then counts as still
    # lagging, unnamed). A slow fault's rank sleeps 3 median steps a step: ~8x the median of 4
    # ranks, ~1.7x that of 2 (of 2 ranks, the median is their mean: never 2x).
    argv = [
        sys.executable, "-m", "goodput", "chaos", str(config), "watch.straggler_steps=5",
        "watch.straggler_ratio=1.5", "--nproc", str(nproc), "--kinds", "slow,stall",
        "--faults", "4", "--output", str(out), *LAUNCH_OPTIONS,
    ]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(
        argv, env=outside_any_job(), capture_output=True, text=True, timeout=900
    )
    print(f"campaign on {nproc} ranks: {time.monotonic() - started:.1f} s")  # the CI budget
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["comparison"]["equal"]
    faults = report["faults"]
    assert Counter(f["kind"] for f in faults) == {"slow": 2, "stall": 2}
    assert {f["where"] for f in faults if f["kind"] == "stall"} == {"data", "collective"}

    # Each fault named: its rank, and the host that rank ran on.
    for fault in faults:
        assert fault["fired_step"] == fault["step"], fault
        named = (fault["named_rank"], fault["named_host"])
        assert fault["host"] and named == (fault["rank"], fault["host"]), fault
        row = next(
            line for line in result.stdout.splitlines() if line.startswith(f"  {fault['id']} ")
        )
        assert row.endswith(f"rank {fault['rank']} on {fault['host']}"), row

    # A stall ended its attempt as a hang whose first evidence is the suspect: the stalled rank
    # out of the collective its peers wait in, at the stall's step, its stack in the hook.
    attempts = read_attempts(out / "faulted" / rundir.ATTEMPTS)
    hook = {"data": "before_data", "collective": "before_step"}
    for fault in (f for f in faults if f["kind"] == "stall"):
        ended = attempts[fault["attempt"] - 1]
        assert (ended.class_, ended.exit_code) == ("hang", 124)
        suspect = ended.evidence[0]
        assert suspect.source == "hang-suspect" and suspect.step == fault["step"]
        assert f"rank {fault['rank']} on {fault['host']}" in suspect.said
        assert f"not in a collective at step {fault['step']}" in suspect.said
        assert "stall <- faults.py:" in suspect.said and hook[fault["where"]] in suspect.said
    # A slow rank's straggler line fell in its window, and no stall was taken for a straggler.
    for fault in (f for f in faults if f["kind"] == "slow"):
        window = range(fault["step"], fault["step"] + fault["steps"])
        lines = [
            item for record in attempts for item in record.evidence
            if item.source == "straggler" and item.step in window
        ]  # fmt: skip
        assert lines and lines[0].rank == fault["rank"] and "warning: straggler: " in lines[0].said
    # The 2 stalls' attempts hung, the last finished; any other attempt failed before its first
    # step (a rendezvous port another process took on a busy machine: retried, as it should be).
    stalled = {fault["attempt"] for fault in faults if fault["kind"] == "stall"}
    assert [a.attempt for a in attempts if a.class_ == "hang"] == sorted(stalled)
    assert attempts[-1].class_ == "success"
    others = [a for a in attempts[:-1] if a.attempt not in stalled]
    assert all(a.class_ == "stuck-pre-training" and a.steps_gained == 0 for a in others), others
