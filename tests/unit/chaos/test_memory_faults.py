"""The faults of in-memory checkpoints and what a campaign makes of them, without a faulted
campaign: ``snapshot-kill`` (``FaultPlan.on_snapshot_write``) and ``host-loss`` (``after_step``: the
host-loss hook, then the bad-node line and exit 1) each in a real process that really dies; their
plan keys and reachability; where the plan draws a snapshot-kill; which kinds a campaign takes by
default and refuses; and, on hand-made faulted runs (written as the launcher, the trainer and the
hooks write them), where each restart loaded from and the verdict: with snapshots every k steps
each fault that ends an attempt loses at most k steps, and a host-loss restart loads its
partner's copy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from goodput import cli
from goodput.chaos import campaign, outcomes, plan
from goodput.chaos.records import FiredRecord
from goodput.chaos.report import Report, format_report
from goodput.config import to_toml
from goodput.errors import ExitCode, GoodputError
from goodput.faults import KINDS, NEEDS_SNAPSHOTS, Fault, load_plan
from goodput.testing.jobs import JOB_PREFIXES, JOB_VARS
from goodput.testing.ranks import launched_on
from goodput.testing.run_dirs import Attempt, write_run
from goodput.testing.tiny import tiny_run_config

T0 = 1_800_000_000.0


def plan_file(tmp_path: Path, *faults: dict) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"fired_dir": str(tmp_path / "fired"), "faults": list(faults)}))
    return path


def load(path: Path):
    loaded = load_plan({"GOODPUT_FAULTS": str(path)})
    assert loaded is not None
    return loaded


# --- the plan entries and their reachability -----------------------------------------------


def test_both_kinds_take_the_four_keys_and_are_indexed_where_their_hooks_look(tmp_path):
    snap = {"id": 0, "kind": "snapshot-kill", "step": 3, "rank": 1}
    lost = {"id": 1, "kind": "host-loss", "step": 5, "rank": 0}
    loaded = load(plan_file(tmp_path, snap, lost))
    assert [fault.keys() for fault in loaded.faults] == [snap, lost]
    assert loaded.in_snapshot == {1: [loaded.faults[0]]} and not loaded.in_save
    assert loaded.by_step == {(5, 0): [loaded.faults[1]]}
    assert loaded.host_loss_hook is None  # the trainer sets it when it keeps snapshots
    for key, value in (("where", "data"), ("seconds", 1.0)):
        with pytest.raises(GoodputError, match=f"kind host-loss\\) has the unknown key '{key}'"):
            load(plan_file(tmp_path, {**lost, key: value}))


@pytest.mark.parametrize("kind", NEEDS_SNAPSHOTS)
def test_a_snapshot_fault_in_a_run_without_snapshots_is_refused_naming_it(tmp_path, kind):
    path = plan_file(tmp_path, {"id": 4, "kind": "kill", "step": 1, "rank": 0},
                     {"id": 7, "kind": kind, "step": 2, "rank": 1})  # fmt: skip
    loaded = load(path)
    with pytest.raises(GoodputError) as refused:
        loaded.check_reachable(world_size=2, steps=8, saves=True, snapshots=False)
    said = refused.value.render()
    assert f"faults[1] (id 7, {kind}): the run takes no memory snapshots" in said
    assert "checkpoint.memory_interval_steps is 0" in said and "would never fire" in said
    assert refused.value.code == ExitCode.USAGE and str(path) in said
    loaded.check_reachable(world_size=2, steps=8, saves=False, snapshots=True)


# --- the hooks, in real processes ----------------------------------------------------------

SNAPSHOT_WRITES = """
import os, sys
from goodput.faults import load_plan
plan = load_plan(os.environ)
for step in (1, 2, 3, 4):
    plan.on_snapshot_write(step, 0)  # another rank: never
    plan.on_snapshot_write(step, 1)
    print(f"snapshot {step} written", flush=True)
"""


def test_a_snapshot_kill_dies_in_the_first_snapshot_of_its_step_or_later_once(tmp_path):
    """Planned at step 2, on rank 1: the process gets through snapshot 1 and dies in snapshot
    2 by SIGKILL; run again (a resumed attempt), it is not killed a second time."""
    path = plan_file(tmp_path, {"id": 2, "kind": "snapshot-kill", "step": 2, "rank": 1})
    env = {**os.environ, "GOODPUT_FAULTS": str(path)}
    argv = [sys.executable, "-c", SNAPSHOT_WRITES]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert first.stdout.splitlines() == ["snapshot 1 written"]
    record = json.loads((tmp_path / "fired" / "2.json").read_text())
    assert (record["kind"], record["step"], record["rank"]) == ("snapshot-kill", 2, 1)
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and len(again.stdout.splitlines()) == 4


HOST_LOSS = """
import os, shutil, sys
from pathlib import Path
from goodput.faults import load_plan
plan = load_plan(os.environ)
if sys.argv[1] == "hooked":  # what the trainer sets: the snapshot store's forget_host
    plan.host_loss_hook = lambda: shutil.rmtree(sys.argv[2])
for step in (1, 2, 3):
    plan.after_step(step, 1)
    print(f"step {step} done", flush=True)
"""


@pytest.mark.parametrize("hooked", [True, False])
def test_a_host_loss_forgets_the_hosts_snapshots_then_dies_as_a_bad_node(tmp_path, hooked):
    """Rank 1 on n2 (the launcher's host list): the hook runs first (its folder is gone), then
    the bad-node line the launcher evicts a host on, exit 1. Without a hook: the line alone."""
    path = plan_file(tmp_path, {"id": 0, "kind": "host-loss", "step": 2, "rank": 1})
    folder = tmp_path / "shm" / "n2"
    folder.mkdir(parents=True)
    (folder / "rank-00001.slot-0.json").write_text("{}")
    env = {**os.environ, "GOODPUT_FAULTS": str(path), "LOCAL_WORLD_SIZE": "1",
           **launched_on(tmp_path, ["n1", "n2.cluster"])}  # fmt: skip
    argv = [sys.executable, "-c", HOST_LOSS, "hooked" if hooked else "bare", str(folder)]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stdout.splitlines() == ["step 1 done"]
    assert result.stderr.strip() == (
        "goodput: error: rank 1 on n2: CUDA error: device lost (injected by goodput chaos)"
    )
    assert folder.exists() != hooked
    assert json.loads((tmp_path / "fired" / "0.json").read_text())["step"] == 2


# --- the plan a campaign draws --------------------------------------------------------------


def draw(kinds, *, interval: int, snapshots: int, seed: int = 0, steps: int = 40):
    return plan.draw_faults(
        plan.deal_kinds(len(kinds), kinds, seed), num_steps=steps, interval_steps=interval,
        num_ranks=2, seed=seed, straggler_steps=5, snapshot_interval_steps=snapshots,
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(10))
def test_a_snapshot_kill_gets_a_snapshot_step_of_its_own(seed):
    kinds = ("snapshot-kill", "snapshot-kill", "ckpt-kill", "kill", "host-loss", "hang")
    faults = draw(kinds, interval=5, snapshots=3, seed=seed)
    snaps = [f.step for f in faults if f.kind == "snapshot-kill"]
    assert len(snaps) == 2 and all(step % 3 == 0 and step < 40 for step in snaps)
    steps = [f.step for f in faults]
    assert steps == sorted(set(steps))  # distinct: no two faults meet in one snapshot
    # A plan without snapshot faults is drawn as before they existed, whatever the interval.
    plain = ("kill", "ckpt-kill", "host-loss", "nan")
    assert draw(plain, interval=5, snapshots=0, seed=seed) == draw(
        plain, interval=5, snapshots=3, seed=seed
    )


def test_snapshot_faults_without_snapshots_enough_are_a_usage_error_naming_faults():
    with pytest.raises(GoodputError) as refused:
        draw(("snapshot-kill",), interval=5, snapshots=0)
    assert refused.value.where == "--faults" and refused.value.code == ExitCode.USAGE
    assert "snapshotting every 0 steps of 40 gives 0" in refused.value.what
    with pytest.raises(GoodputError, match="2 snapshot fault"):
        draw(("snapshot-kill", "snapshot-kill"), interval=0, snapshots=20)  # only step 20


def test_the_default_kinds_follow_the_launch_and_the_snapshots():
    def kinds(spares: int, hosts: int, snapshots: bool):
        return campaign._kinds(None, num_spares=spares, num_hosts=hosts, snapshots=snapshots)

    everything = tuple(k for k in KINDS if k not in campaign.ASKED_ONLY)
    assert kinds(1, 2, True) == (everything, [])
    without = tuple(k for k in everything if k not in NEEDS_SNAPSHOTS)
    assert kinds(1, 2, False) == (without, [])
    assert kinds(0, 1, False) == (
        tuple(k for k in without if k != "bad-node"),
        ["bad-node left out: this launch has no spare host to replace a bad one"],
    )
    local, (note,) = kinds(0, 1, True)
    assert "bad-node" not in local and "host-loss" not in local and "snapshot-kill" in local
    assert note.startswith("bad-node and host-loss left out: ")
    one_host, (note,) = kinds(1, 1, True)
    assert "bad-node" in one_host and "host-loss" not in one_host
    assert note.startswith("host-loss left out: on one host, no partner")
    assert campaign._kinds(("kill",), num_spares=0, num_hosts=1, snapshots=False) == (("kill",), [])


@pytest.fixture
def tiny_config(tmp_path, monkeypatch) -> Path:
    """The tiny config, for campaigns run in this process outside any job."""
    for name in list(os.environ):
        if name.startswith(JOB_PREFIXES) or name in JOB_VARS:
            monkeypatch.delenv(name)
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(tiny_run_config(tmp_path)))
    return config


def refused(argv: list[str], capsys) -> str:
    """``goodput chaos ARGV``'s one error line: exit 2, before anything is written."""
    capsys.readouterr()
    assert cli.main(["chaos", *argv]) == ExitCode.USAGE
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--kinds", "kill,snapshot-kill"],
         "--kinds: snapshot-kill fault(s) need memory snapshots; the config takes none "
         "(checkpoint.memory_interval_steps is 0); add the override "
         "checkpoint.memory_interval_steps=K"),
        (["--kinds", "host-loss", "checkpoint.memory_interval_steps=1"],
         "--kinds: 8 host-loss fault(s) need as many spare hosts; this launch has 0"),
        (["--kinds", "bad-node,host-loss", "checkpoint.memory_interval_steps=1", "--faults", "2"],
         "--kinds: 2 bad-node and host-loss fault(s) need as many spare hosts"),
        (["--kinds", "snapshot-kill", "checkpoint.memory_interval_steps=30", "--faults", "1"],
         "--faults: 1 snapshot fault(s) need as many memory snapshots before the last step "
         "(outside the other faults' steps); snapshotting every 30 steps of 8 gives 0"),
    ],
)  # fmt: skip
def test_a_campaign_refuses_snapshot_faults_it_cannot_recover_from(tiny_config, capsys, args, said):
    out = tiny_config.parent / "campaign"
    assert said in refused([str(tiny_config), "--nproc", "2", "--output", str(out), *args], capsys)
    assert not out.exists()


def test_a_host_loss_on_one_host_is_refused_even_with_a_spare(tiny_config, capsys, monkeypatch):
    """An emulated PBS job of two hosts, the run on one of them: no partner holds a copy."""
    nodefile = tiny_config.parent / "nodefile"
    nodefile.write_text("n1\nn2\n")
    profile = tiny_config.parent / "emulated.toml"
    profile.write_text('ppn = 1\nmpiexec = "hydra"\n')
    for name, value in (("PBS_JOBID", "1.emulated"), ("PBS_NODEFILE", str(nodefile)),
                        ("GOODPUT_PROFILE", str(profile))):  # fmt: skip
        monkeypatch.setenv(name, value)
    out = tiny_config.parent / "campaign"
    argv = [str(tiny_config), "checkpoint.memory_interval_steps=1", "--kinds", "host-loss",
            "--faults", "1", "--output", str(out), "--", "--nhosts", "1"]  # fmt: skip
    assert "--kinds: host-loss needs two hosts or more: on one host, no partner" in refused(
        argv, capsys
    )
    assert not out.exists()


# --- outcomes and the verdict on hand-made faulted runs -------------------------------------


def faulted_run(tmp_path: Path, *, back: list[tuple[str, int]], k: int) -> Report:
    """Three attempts of 1 s steps on n1,n2: the first runs steps 1-6 and is killed (a
    snapshot-kill of step 6: its rank died in the snapshot's write), the second resumes at
    ``back[0]`` and runs to 12, where a host-loss of rank 1 ends it; the third resumes at
    ``back[1]`` and finishes step 20. (The helper lists a host and those it replaced: the
    second attempt ran on n1,n2 and replaced n2 by n3.)"""
    (first_from, first_at), (second_from, second_at) = back
    attempts = [
        Attempt(start=T0, startup_s=2.0, steps=range(1, 7), tail_s=0.5, class_="error",
                exit_code=137, wait_s=0.5, host="n1"),
        Attempt(start=T0 + 10, startup_s=2.0, steps=range(first_at + 1, 13), tail_s=0.5,
                class_="bad-node", exit_code=1, wait_s=0.5, resumed=(first_from, first_at),
                host="n1", replaced={"n2": "n3"}),
        Attempt(start=T0 + 30, startup_s=2.0, steps=range(second_at + 1, 21),
                resumed=(second_from, second_at), host="n1"),
    ]  # fmt: skip
    write_run(tmp_path, attempts, checkpoints=[10, 20], done=True)
    run = campaign.account_run(tmp_path)
    planned = [Fault(0, "snapshot-kill", 6, 0), Fault(1, "host-loss", 12, 1)]
    fired = [FiredRecord(0, "snapshot-kill", 6, 0, T0 + 8.2),
             FiredRecord(1, "host-loss", 12, 1, T0 + 10 + 2 + (12 - first_at) + 0.1)]  # fmt: skip
    found = outcomes.fault_outcomes(planned, fired, run.accounting.timeline, ranks_per_host=1)
    return Report(
        config="run.toml", output="report.json", seed=0, num_ranks=2,
        kinds=("snapshot-kill", "host-loss"), notes=(), idle_timeout_s=10.0,
        memory_interval_steps=k, faults=tuple(found), attempts=tuple(run.files.attempts),
        faulted=run.accounting, reference=run.accounting, unfinished=None, comparison=None,
    )  # fmt: skip


def fault_row(report: Report, fault_id: int) -> list[str]:
    text = format_report(report).splitlines()
    return next(line for line in text if line.startswith(f"  {fault_id} ")).split()


def test_each_restart_says_where_it_loaded_from_and_keeps_to_k(tmp_path):
    report = faulted_run(tmp_path, back=[("snapshot", 5), ("partner", 11)], k=1)
    snap, lost = report.faults
    assert (snap.steps_lost, snap.loaded_from, snap.resumed_step) == (1, "snapshot", 5)
    assert (lost.host, lost.steps_lost) == ("n2", 1)  # rank 1's host where it fired
    assert (lost.loaded_from, lost.resumed_step) == ("partner", 11)
    assert not report.lost_too_many and not report.not_from_partner
    assert fault_row(report, 0)[1:3] == ["snapshot-kill", "0"]
    assert "snapshot" in fault_row(report, 0) and "partner" in fault_row(report, 1)
    text = format_report(report)
    assert "memory snapshots every 1 step(s): each of the 2 fault(s) that ended an attempt " in text
    assert "FAILED" not in text
    written = report.to_json()
    assert written["memory_interval_steps"] == 1
    assert [(f["loaded_from"], f["resumed_step"]) for f in written["faults"]] == [
        ("snapshot", 5), ("partner", 11),
    ]  # fmt: skip
    json.dumps(written, allow_nan=False)


def test_more_steps_lost_than_k_or_a_host_loss_not_from_its_partner_fails(tmp_path):
    report = faulted_run(tmp_path, back=[("checkpoint", 3), ("checkpoint", 10)], k=2)
    snap, lost = report.faults
    assert (snap.steps_lost, lost.steps_lost) == (3, 2)
    assert report.lost_too_many == [snap] and report.not_from_partner == [lost]
    text = format_report(report)
    assert (
        "FAILED: fault 0 (snapshot-kill at step 6 on rank 0): 3 steps lost, more than "
        "checkpoint.memory_interval_steps = 2" in text
    )
    assert (
        "FAILED: fault 1 (host-loss at step 12 on rank 1): the restart loaded from checkpoint, "
        "not from the lost host's partner copy" in text
    )
    assert "memory snapshots every" not in text
    # The passed verdict, once the rest holds: only these two fail it.
    assert not report.passed and report.to_json()["passed"] is False


def test_without_snapshots_steps_lost_are_not_bounded_and_an_unsaid_source_is_none(tmp_path):
    report = faulted_run(tmp_path, back=[("checkpoint", 0), ("checkpoint", 10)], k=0)
    assert report.faults[0].steps_lost == 6 and not report.lost_too_many
    assert "memory snapshots every" not in format_report(report)
    # A restart whose first record names no source (a fresh start): None, "-" in the table.
    plain = Attempt(start=T0, startup_s=1.0, steps=range(1, 4), tail_s=0.5, class_="error",
                    exit_code=137, wait_s=0.5)  # fmt: skip
    again = Attempt(start=T0 + 6, startup_s=1.0, steps=range(1, 5))
    write_run(tmp_path / "fresh", [plain, again], done=True)
    timeline = campaign.account_run(tmp_path / "fresh").accounting.timeline
    (outcome,) = outcomes.fault_outcomes(
        [Fault(0, "kill", 3, 0)], [FiredRecord(0, "kill", 3, 0, T0 + 4.2)], timeline,
        ranks_per_host=1,
    )  # fmt: skip
    assert outcome.steps_lost == 3 and outcome.loaded_from is None and outcome.resumed_step is None
