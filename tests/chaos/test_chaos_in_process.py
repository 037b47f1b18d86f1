"""``goodput chaos ... -- --in-process --spares-warm 1`` through the real CLI, as the docs show it:
real ranks of the tiny config really SIGKILLed after a step and really SIGSTOPped, on 4 local
CPU ranks. The other ranks keep their processes (the same pids in every generation, by their
own lines), a warm spare takes the dead or hung rank's place, and the run ends bitwise equal to
its straight run. Without a warm spare the recovery falls back to today's full restart, said in
the attempts log, and still ends bitwise equal."""

from __future__ import annotations

import json
import re

import pytest

from goodput import rundir
from goodput.launch.history import read_attempts
from tests.chaos.test_chaos_memory import LAUNCH_OPTIONS, goodput_chaos, memory_dir, write_config

GENERATION_LINE = re.compile(
    r"^\[(rank|spare)(\d+)\] train: rank (\d+), pid (\d+), generation (\d+)$"
)


def generations(output: str) -> dict[int, dict[int, int]]:
    """generation -> rank -> pid, from the ranks' own lines in a launch's ``output``."""
    found: dict[int, dict[int, int]] = {}
    for line in output.splitlines():
        if match := GENERATION_LINE.match(line):
            rank, pid, generation = (int(match[i]) for i in (3, 4, 5))
            found.setdefault(generation, {})[rank] = pid
    return found


@pytest.mark.timeout(600)
def test_a_kill_and_a_hang_of_four_ranks_recover_in_process_bitwise_equal(tmp_path):
    config, out = write_config(tmp_path, steps=20, saves_every=10), tmp_path / "c"
    result = goodput_chaos(
        [str(config), "--nproc", "4", "checkpoint.memory_interval_steps=1",
         f"checkpoint.memory_dir={memory_dir(tmp_path)}", "--kinds", "kill,hang",
         "--faults", "2", "--seed", "1", "--output", str(out), "--", *LAUNCH_OPTIONS,
         "--in-process", "--spares-warm", "1"],
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["comparison"]["equal"], result.stdout
    faults = sorted(report["faults"], key=lambda fault: fault["fired_step"])
    assert sorted(fault["kind"] for fault in faults) == ["hang", "kill"]
    records = read_attempts(out / "faulted" / rundir.ATTEMPTS)
    recovered = [record for record in records if record.recovery is not None]
    assert len(recovered) == 2 and len(records) == 3, records
    for fault, record in zip(faults, recovered, strict=True):
        assert record.recovery.fallback is None and record.recovery.rank == fault["rank"]
        assert fault["loaded_from"] == "snapshot" and fault["steps_lost"] <= 1, fault
        parts = fault["in_process_recovery"]
        assert set(parts) == {"detection_s", "abort_s", "rendezvous_s", "restore_s",
                              "rebuild_s", "first_step_s"}  # fmt: skip
    # The survivors kept their processes: the same pid in every generation.
    pids = generations((out / "faulted" / "launch.log").read_text())
    assert sorted(pids) == [0, 1, 2] and all(len(ranks) == 4 for ranks in pids.values()), pids
    for generation in (1, 2):
        died = recovered[generation - 1].recovery.rank
        kept = [rank for rank in range(4) if rank != died]
        assert all(pids[generation][r] == pids[generation - 1][r] for r in kept), pids
        assert pids[generation][died] != pids[generation - 1][died]
    badput = report["goodput"]["faulted"]["badput_s"]
    assert badput["in_process_recovery"] > 0 and badput["startup"] > 0  # the first start alone
    assert badput["backoff"] < 0.5  # no wait and no host probe before a recovery in process


@pytest.mark.timeout(600)
def test_without_a_warm_spare_the_run_restarts_whole_and_says_why(tmp_path):
    config, out = write_config(tmp_path, steps=12, saves_every=6), tmp_path / "c"
    goodput_chaos(
        [str(config), "--nproc", "2", "checkpoint.memory_interval_steps=1",
         f"checkpoint.memory_dir={memory_dir(tmp_path)}", "--kinds", "kill", "--faults", "1",
         "--seed", "1", "--output", str(out), "--", *LAUNCH_OPTIONS, "--in-process"],
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["comparison"]["equal"]
    records = read_attempts(out / "faulted" / rundir.ATTEMPTS)
    # The death's attempt, the in-process attempt that fell back at once, the full restart.
    assert [record.recovery is not None for record in records] == [False, True, False]
    assert records[1].recovery.fallback == "no warm spare is alive"
    assert records[2].class_ == "success" and report["faults"][0]["loaded_from"] == "snapshot"
    log = (out / "faulted" / "launch.log").read_text()
    assert "in-process recovery failed: no warm spare is alive; stopping all processes" in log
