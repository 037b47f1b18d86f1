"""Whom the launcher named for each ``slow`` and ``stall`` fault, from a hand-made faulted run
(attempts, metrics and fired records written as the launcher, the trainer and the hooks write
them): a stall takes its attempt's hang suspect, a slow fault the first straggler evidence in
its window; ``passed`` needs both right, and the report says which was not. And what that
rests on: a rank that lags twice is named twice, and the launcher keeps both lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from goodput.chaos import campaign, outcomes
from goodput.chaos.records import FiredRecord
from goodput.chaos.report import Report, format_report
from goodput.faults import Fault
from goodput.launch.failover import EvidenceScanner
from goodput.launch.history import Evidence
from goodput.testing.run_dirs import Attempt, write_run
from goodput.testing.wire import in_lockstep
from goodput.train.config.run import WatchConfig
from goodput.train.monitor.stragglers import StragglerWatch
from goodput.train.step_vote import Ballot, cast

T0 = 1_800_000_000.0
HOST = "nid0007"


def suspect(rank: int, step: int) -> Evidence:
    said = f"hang suspect: rank {rank} on {HOST} (pid 41) not in a collective at step {step}"
    return Evidence(HOST, said, "hang-suspect", rank=rank, step=step)


def straggler(rank: int, step: int) -> Evidence:
    said = f"warning: straggler: rank {rank} on {HOST} busy 3.10x the median over steps 1-{step}"
    return Evidence(HOST, said, "straggler", rank=rank, step=step)


STALL = Fault(0, "stall", 9, 1, where="data")
SLOW = Fault(1, "slow", 18, 1, seconds=0.1, steps=10)  # its window: steps 18-27


def faulted_run(tmp_path: Path, *, hang_evidence, later_evidence) -> Report:
    """Attempt 1 (steps 1-8, 1 s each from T0 + 2) stalls at step 9 and is ended as a hang;
    attempt 2 (from T0 + 20) resumes at step 5 and runs to 30; the slow fault first fires
    in it, at step 18."""
    attempts = [
        Attempt(start=T0, startup_s=2.0, steps=range(1, 9), tail_s=4.0, class_="hang",
                exit_code=124, timed_out=True, wait_s=1.0, evidence=hang_evidence, host=HOST),
        Attempt(start=T0 + 20, startup_s=2.0, steps=range(5, 31), evidence=later_evidence,
                host=HOST),
    ]  # fmt: skip
    write_run(tmp_path, attempts, checkpoints=[4, 30], done=True)
    run = campaign.account_run(tmp_path)
    fired = [
        FiredRecord(0, "stall", 9, 1, T0 + 10.5),  # the data phase of step 9
        FiredRecord(1, "slow", 18, 1, T0 + 20 + 2 + 13.1),  # step 18 of attempt 2
    ]
    found = outcomes.fault_outcomes([STALL, SLOW], fired, run.accounting.timeline, ranks_per_host=2)
    return Report(
        config="run.toml", output="report.json", seed=0, num_ranks=2, kinds=("slow", "stall"),
        notes=(), idle_timeout_s=3.0, memory_interval_steps=0, faults=tuple(found),
        attempts=tuple(run.files.attempts),
        faulted=run.accounting, reference=run.accounting, unfinished=None, comparison=None,
    )  # fmt: skip


def test_each_fault_takes_the_evidence_that_names_it(tmp_path):
    report = faulted_run(
        tmp_path,
        hang_evidence=(suspect(1, 9), suspect(0, 9)),  # the first suspect is the one taken
        # Outside the window (step 12), then in it: the one in the window names the slow rank.
        later_evidence=(straggler(0, 12), straggler(1, 22), straggler(0, 25)),
    )
    stall, slow = report.faults
    assert (stall.attempt, stall.host, stall.named_rank, stall.named_host) == (1, HOST, 1, HOST)
    assert (slow.host, slow.named_rank, slow.named_host) == (HOST, 1, HOST)
    assert stall.named_right and slow.named_right and not report.misnamed
    # A stall ends its attempt: 10.5 -> 14 s, and 5 s of the launcher's beyond the 1 s wait.
    assert stall.detection_s == pytest.approx(8.5, abs=2e-3)
    row = next(line for line in format_report(report).splitlines() if line.startswith("  1 "))
    assert row.endswith(f"rank 1 on {HOST}")
    faults = report.to_json()["faults"]
    assert [(f["host"], f["named_rank"], f["named_host"]) for f in faults] == [(HOST, 1, HOST)] * 2
    json.dumps(report.to_json(), allow_nan=False)


def test_a_wrong_or_missing_naming_fails_the_campaign_saying_which(tmp_path):
    report = faulted_run(
        tmp_path,
        hang_evidence=(suspect(0, 9),),  # the peer, not the stalled rank
        later_evidence=(straggler(1, 12), straggler(1, 28)),  # both outside the window
    )
    stall, slow = report.faults
    assert (stall.named_rank, slow.named_rank) == (0, None)
    assert report.misnamed == [stall, slow]
    text = format_report(report)
    assert (
        f"FAILED: fault 0 (stall at step 9 on rank 1 on {HOST}): the launcher named rank 0 on "
        f"{HOST}" in text
    )
    assert f"FAILED: fault 1 (slow at step 18 on rank 1 on {HOST}): the launcher named no one" in (
        text
    )
    assert "rank 0 on nid0007 WRONG" in text and "NO ONE" in text


def test_the_host_is_the_ranks_own_among_several(tmp_path):
    """Four ranks, two a host: rank 3 is on the second host of the attempt it fired in."""
    # The testing helper lists a replaced host among the attempt's: nid0002 is its second.
    attempt = Attempt(start=T0, startup_s=1.0, steps=range(1, 30), host="nid0001",
                      replaced={"nid0002": "nid0009"}, wait_s=1.0)  # fmt: skip
    write_run(tmp_path, [attempt], done=True)
    timeline = campaign.account_run(tmp_path).accounting.timeline
    slow = Fault(0, "slow", 3, 3, seconds=0.1, steps=10)
    (outcome,) = outcomes.fault_outcomes(
        [slow], [FiredRecord(0, "slow", 3, 3, T0 + 3.5)], timeline, ranks_per_host=2
    )
    assert outcome.host == "nid0002" and outcome.named_rank is None and not outcome.named_right


def test_a_rank_that_lags_twice_is_named_twice_and_the_launcher_keeps_both(tmp_path, capsys):
    """What naming every slow fault rests on: the watch names a rank once per lag (again after a
    whole window at its peers' pace), and the launcher's scanner keeps each of those lines."""
    cfg = WatchConfig(straggler_ratio=1.2, straggler_steps=5)
    slow = set(range(1, 11)) | set(range(16, 21))  # two lags, a window at pace between them

    def rank_watch(wire):
        watch = StragglerWatch(cfg, [HOST, HOST], wire, run_dir=tmp_path)
        for step in range(0, 26):  # step 0: the process's first, warm-up, never judged
            busy_s = 0.4 if wire.rank == 1 and step in slow else 0.1
            ballot = Ballot(sigterm=False, minutes_due=False, snapshot_ok=True, busy_s=busy_s)
            watch.observe(step, busy_s, cast(wire, ballot).busy)

    in_lockstep(rank_watch, 2)
    lines = [line for line in capsys.readouterr().out.splitlines() if "straggler:" in line]
    assert len(lines) == 2 and "steps 1-5" in lines[0] and "steps 16-20" in lines[1]
    scanner = EvidenceScanner([], [HOST])
    for line in lines:
        scanner(f"[rank0]: {line}".encode())
    kept = [(item.rank, item.step) for item in scanner.stragglers.values()]
    assert kept == [(1, 5), (1, 20)]
