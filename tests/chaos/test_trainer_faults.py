"""Injected faults (``goodput.faults``) fire in real ``python -m goodput train`` processes:
SIGKILL really kills, SIGSTOP really stops, the bad-node line reaches stderr in the form the
launcher reads, a failing save is reported while training goes on, NaN gradients are skipped and
stop the run when too many come in a row — and each fault fires once, across restarts."""

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from goodput.config import to_toml
from goodput.errors import GoodputError
from goodput.faults import load_plan
from goodput.launch.failover import BAD_NODE_PATTERNS
from goodput.ranks import launcher_host
from goodput.rundir import LATEST, checkpoints_dir, list_checkpoints, step_dir
from goodput.testing.ranks import launched_on, start, start_ranks
from goodput.testing.tiny import tiny_run_config

TIMEOUT_S = 240


@pytest.fixture(autouse=True)
def no_process_left(monkeypatch):
    """Every process a test starts is gone when it ends, whatever it asserted."""
    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    yield
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def write_run(tmp_path, faults, max_skipped_steps=5, **checkpoint):
    """The tiny run's config (8 steps, a checkpoint every 2) and a plan of ``faults`` given as
    (id, kind, step, rank): (config path, run dir, environment)."""
    cfg = tiny_run_config(tmp_path)
    cfg = replace(
        cfg,
        train=replace(cfg.train, max_skipped_steps=max_skipped_steps),
        checkpoint=replace(cfg.checkpoint, **{"interval_steps": 2, **checkpoint}),
    )
    config = tmp_path / "run.toml"
    config.write_text(to_toml(cfg))
    plan = tmp_path / "plan.json"
    entries = [dict(zip(("id", "kind", "step", "rank"), fault, strict=True)) for fault in faults]
    plan.write_text(json.dumps({"fired_dir": str(tmp_path / "fired"), "faults": entries}))
    return config, Path(cfg.train.run_dir), {"GOODPUT_FAULTS": str(plan)}


def fired(tmp_path, fault_id):
    return json.loads((tmp_path / "fired" / f"{fault_id}.json").read_text())


def steps_printed(out):
    return [int(line.split()[0][5:]) for line in out.splitlines() if line.startswith("step=")]


def wait_stopped(pid):
    deadline = time.monotonic() + TIMEOUT_S
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "never stopped"
        time.sleep(0.05)


def test_kill_kills_after_its_step_and_fires_once_across_a_restart(tmp_path):
    # Synchronous saves: the checkpoint of step 2 is complete when step 3 starts.
    config, run_dir, env = write_run(tmp_path, [(7, "kill", 3, 0)], async_save=False)
    killed = start(config, env)
    out, err = killed.communicate(timeout=TIMEOUT_S)
    assert killed.returncode == -signal.SIGKILL, err
    assert steps_printed(out) == [1, 2, 3]
    record = fired(tmp_path, 7)
    assert {k: record[k] for k in ("id", "kind", "step", "rank")} == {
        "id": 7,
        "kind": "kill",
        "step": 3,
        "rank": 0,
    }
    assert abs(record["time"] - time.time()) < TIMEOUT_S

    rerun = start(config, env)  # same plan: the fault has fired, the run goes past step 3
    out, err = rerun.communicate(timeout=TIMEOUT_S)
    assert rerun.returncode == 0, err
    assert f"resume: from {step_dir(checkpoints_dir(run_dir), 2)}" in out
    assert steps_printed(out) == list(range(3, 9))
    assert fired(tmp_path, 7) == record  # not fired, not rewritten


def test_ckpt_kill_dies_inside_the_flush_and_that_checkpoint_is_never_used(tmp_path):
    config, run_dir, env = write_run(tmp_path, [(0, "ckpt-kill", 3, 0)])
    killed = start(config, env)
    _, err = killed.communicate(timeout=TIMEOUT_S)
    assert killed.returncode == -signal.SIGKILL, err
    assert fired(tmp_path, 0)["step"] == 4  # the first save at or after step 3
    root = checkpoints_dir(run_dir)
    saved = {c.step: c for c in list_checkpoints(root)}
    assert saved[2].complete and not saved[4].complete
    assert list(saved[4].path.glob("*.distcp"))  # killed while writing, not before
    assert (root / LATEST).read_text().strip() == "step-00000002"

    rerun = start(config, env)
    out, err = rerun.communicate(timeout=TIMEOUT_S)
    assert rerun.returncode == 0, err
    assert f"skipping checkpoint {saved[4].path}: incomplete" in out
    assert f"resume: from {saved[2].path}" in out
    assert steps_printed(out) == list(range(3, 9))


def test_bad_node_prints_the_evidence_line_the_launcher_reads_and_exits_1(tmp_path):
    config, _, env = write_run(tmp_path, [(3, "bad-node", 2, 1)], interval_steps=0)
    env |= launched_on(tmp_path, ["node-a.cluster.example", "node-b.cluster.example"])
    rank0, rank1 = start_ranks(config, env)
    _, err = rank1.communicate(timeout=TIMEOUT_S)
    assert rank1.returncode == 1
    line = err.strip().splitlines()[-1]
    assert line == (
        "goodput: error: rank 1 on node-b: CUDA error: device lost (injected by goodput chaos)"
    )
    hosts = {m["host"] for p in BAD_NODE_PATTERNS if "host" in p and (m := re.search(p, line))}
    assert hosts == {"node-b"}
    assert fired(tmp_path, 3)["step"] == 2
    out, _ = rank0.communicate(timeout=TIMEOUT_S)  # its peer is gone: it fails, it does not hang
    assert rank0.returncode != 0 and steps_printed(out) == [1, 2]


def test_a_save_failing_on_one_rank_is_reported_and_a_stopped_rank_goes_on_when_continued(
    tmp_path,
):
    # save-fail on rank 1 from step 3 (the save of step 4); rank 0 stops itself after step 5.
    config, run_dir, env = write_run(tmp_path, [(0, "save-fail", 3, 1), (1, "hang", 5, 0)])
    rank0, rank1 = start_ranks(config, env)
    before_stop = []  # the failed save's report may come before step 5's line, or after it
    for line in rank0.stdout:
        before_stop.append(line)
        if line.startswith("step=5 "):
            break
    wait_stopped(rank0.pid)
    # Frozen mid-run: the failed checkpoint never completes, the one before stands as latest.
    root = checkpoints_dir(run_dir)
    saved = {c.step: c for c in list_checkpoints(root)}
    assert saved[2].complete and (4 not in saved or not saved[4].complete)
    assert (root / LATEST).read_text().strip() == "step-00000002"
    previous = {p.name: p.read_bytes() for p in saved[2].path.rglob("*") if p.is_file()}
    assert rank1.poll() is None  # blocked in a collective on its stopped peer

    os.kill(rank0.pid, signal.SIGCONT)
    out, err = rank0.communicate(timeout=TIMEOUT_S)
    assert rank0.returncode == 0, err
    _, err = rank1.communicate(timeout=TIMEOUT_S)
    assert rank1.returncode == 0, err
    report = [
        line for line in "".join(before_stop).splitlines() + out.splitlines() if "FAILED" in line
    ]
    assert report == [
        f"checkpoint: saving {step_dir(root, 4)} FAILED on rank(s) 1: disk full ([Errno 28] No "
        "space left on device (injected by goodput chaos)); previous checkpoints are intact, "
        "training goes on"
    ]
    assert steps_printed(out) == list(range(6, 9))  # the rest of the run; 1-5 were read above
    assert [(c.step, c.complete) for c in list_checkpoints(root)] == [
        (2, True),
        (6, True),
        (8, True),
    ]
    assert {p.name: p.read_bytes() for p in saved[2].path.rglob("*") if p.is_file()} == previous
    assert (root / LATEST).read_text().strip() == "step-00000008"
    assert fired(tmp_path, 0)["step"] == 4 and fired(tmp_path, 1)["step"] == 5


def test_nan_gradients_are_skipped_and_too_many_in_a_row_stop_the_run_on_every_resume(
    tmp_path,
):
    # NaN on rank 1 at steps 3-5; three in a row stop the run. The checkpoint of step 4 holds
    # two in a row, so the resumed run stops at step 5 again rather than starting the count anew.
    nans = [(i, "nan", step, 1) for i, step in enumerate((3, 4, 5))]
    config, run_dir, env = write_run(tmp_path, nans, max_skipped_steps=3, interval_steps=4)
    for attempt in range(2):
        ranks = start_ranks(config, env)
        outputs = [rank.communicate(timeout=TIMEOUT_S) for rank in ranks]
        for rank, (_, err) in zip(ranks, outputs, strict=True):
            assert rank.returncode == 1, err
            assert err.strip().splitlines()[-1] == (
                "goodput: error: train: stopped at step 5: the gradient norm was not finite for "
                "3 steps in a row (steps 3-5; train.max_skipped_steps = 3); the run diverged or "
                "its data is broken: resume from an earlier checkpoint with a lower learning "
                "rate, or check the data of those steps"
            )
        out = outputs[0][0]
        assert steps_printed(out) == ([1, 2, 3, 4, 5] if attempt == 0 else [5])
        skipped = [line for line in out.splitlines() if "SKIPPED" in line]
        assert [line.split()[0] for line in skipped] == (
            ["step=3", "step=4", "step=5"] if attempt == 0 else ["step=5"]
        )
        assert "grad_norm=nan" in skipped[-1] and "(3 skipped in all)" in skipped[-1]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"], r["skipped_steps"]) for r in records] == [
        (1, False, 0),
        (2, False, 0),
        (3, True, 1),
        (4, True, 2),
        (5, True, 3),
        (5, True, 3),  # the resumed run's
    ]
    assert records[2]["grad_norm"] is None and records[1]["grad_norm"] > 0
    assert [c.step for c in list_checkpoints(checkpoints_dir(run_dir))] == [4]
    assert fired(tmp_path, 0)["step"] == 3  # recorded the first time; it fired again regardless


def test_no_plan_costs_nothing_and_a_bad_plan_is_one_line_naming_it(tmp_path):
    assert load_plan({}) is None and load_plan({"GOODPUT_FAULTS": ""}) is None
    plan = tmp_path / "plan.json"
    cases = {
        '{"fired_dir": "/f", "faults": [{"id": 0, "kind": "melt", "step": 1, "rank": 0}]}': (
            'faults[0].kind "melt" is not one of kill, ckpt-kill, hang, bad-node, save-fail, nan, '
            "slow, stall, snapshot-kill, host-loss"
        ),
        '{"fired_dir": "/f", "faults": [{"id": 0, "kind": "kill", "step": 0, "rank": 0}]}': (
            "faults[0].step is 0, not an integer in [1, 9007199254740992]"
        ),
        '{"fired_dir": "/f", "faults": [], "seed": 1}': "the plan has the unknown key 'seed'",
        '{"fired_dir": "f", "faults": []}': "fired_dir is not an absolute path",
    }
    for text, what in cases.items():
        plan.write_text(text)
        with pytest.raises(GoodputError) as refused:
            load_plan({"GOODPUT_FAULTS": str(plan)})
        assert refused.value.where == f"GOODPUT_FAULTS={str(plan)!r}"
        assert refused.value.what == what and refused.value.code == 2
    with pytest.raises(GoodputError, match="is not an absolute path"):
        load_plan({"GOODPUT_FAULTS": "plan.json"})


def test_the_bad_node_host_is_the_launchers_name_for_the_rank():
    assert launcher_host(5, ("n0", "n1.x.org", "n2"), 2) == "n2"
    assert launcher_host(3, ("n0", "n1.x.org", "n2"), 2) == "n1"
    local = os.uname().nodename.split(".")[0]
    for hosts, per_host in ((("n0",), 0), (("n0",), 1), ((), 1)):
        assert launcher_host(1 if hosts else 0, hosts, per_host) == local
