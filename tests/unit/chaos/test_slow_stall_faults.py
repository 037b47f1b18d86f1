"""The ``slow`` and ``stall`` faults' hooks (``FaultPlan.before_data``, ``before_step``), each on
a real clock or a real process: a slow rank really sleeps on each step of its window and only
there, replays included, with one fired record; a stalled rank really blocks, alive (a
faulthandler dump, as the launcher's forensics asks for, shows it in ``stall``), and the resumed
process gets past it. A hostile plan entry is refused naming the key and the kind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from goodput.errors import GoodputError
from goodput.faults import load_plan

SLOW_S = 0.05


def plan_file(tmp_path: Path, *faults: dict) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"fired_dir": str(tmp_path / "fired"), "faults": list(faults)}))
    return path


def load(path: Path):
    plan = load_plan({"GOODPUT_FAULTS": str(path)})
    assert plan is not None
    return plan


def slept(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def test_a_slow_rank_sleeps_on_each_step_of_its_window_and_only_there(tmp_path):
    slow = {"id": 3, "kind": "slow", "step": 4, "rank": 1, "seconds": SLOW_S, "steps": 3}
    path = plan_file(tmp_path, slow)
    plan = load(path)
    for step in range(1, 9):
        on_rank_1 = slept(lambda step=step: plan.before_step(step, 1))
        assert (on_rank_1 >= SLOW_S) == (4 <= step <= 6), step
        assert slept(lambda step=step: plan.before_step(step, 0)) < SLOW_S  # never another rank
        assert slept(lambda step=step: plan.before_data(step, 1)) < SLOW_S  # not the data hook
    record = json.loads((tmp_path / "fired" / "3.json").read_text())
    assert (record["kind"], record["step"], record["rank"]) == ("slow", 4, 1)  # its first firing
    # A resumed process replays the window: the rank is slow again, the record stays the first.
    assert slept(lambda: load(path).before_step(5, 1)) >= SLOW_S
    assert json.loads((tmp_path / "fired" / "3.json").read_text()) == record


STALLED = """
import faulthandler, os, signal, sys
from goodput.faults import load_plan
faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=False)
plan = load_plan(os.environ)
getattr(plan, sys.argv[1])(int(sys.argv[2]), int(sys.argv[3]))
print("went on", flush=True)
"""


def hook(path: Path, name: str, step: int, rank: int) -> subprocess.Popen[str]:
    env = {**os.environ, "GOODPUT_FAULTS": str(path)}
    argv = [sys.executable, "-c", STALLED, name, str(step), str(rank)]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.parametrize(("where", "fires_in", "not_in"), [
    ("data", "before_data", "before_step"),
    ("collective", "before_step", "before_data"),
])  # fmt: skip
def test_a_stalled_rank_blocks_alive_once_and_the_resumed_one_goes_on(
    tmp_path, where, fires_in, not_in
):
    path = plan_file(tmp_path, {"id": 0, "kind": "stall", "step": 7, "rank": 1, "where": where})
    # The other hook, another step or another rank: no stall, and no record.
    for name, step, rank in ((not_in, 7, 1), (fires_in, 6, 1), (fires_in, 7, 0)):
        assert hook(path, name, step, rank).communicate(timeout=60)[0] == "went on\n"
    assert not (tmp_path / "fired").exists()

    stalled = hook(path, fires_in, 7, 1)
    record = tmp_path / "fired" / "0.json"
    deadline = time.monotonic() + 60
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert stalled.poll() is None  # blocked, and alive
    stalled.send_signal(signal.SIGUSR2)  # a stack dump: it still runs its handlers
    time.sleep(0.5)
    stalled.kill()
    out, err = stalled.communicate(timeout=60)
    assert out == "" and " in stall\n" in err and f" in {fires_in}\n" in err, err
    assert json.loads(record.read_text())["step"] == 7
    # The resumed process: the stall has fired once, so this one goes on.
    assert hook(path, fires_in, 7, 1).communicate(timeout=60)[0] == "went on\n"


@pytest.mark.parametrize(("entry", "said"), [
    ({"kind": "slow", "seconds": 1}, "faults[0] (kind slow) lacks the key 'steps'"),
    ({"kind": "slow", "seconds": 1, "steps": 2, "where": "data"},
     "faults[0] (kind slow) has the unknown key 'where'"),
    ({"kind": "stall"}, "faults[0] (kind stall) lacks the key 'where'"),
    ({"kind": "kill", "seconds": 1}, "faults[0] (kind kill) has the unknown key 'seconds'"),
    ({"kind": "stall", "where": "disk"}, 'faults[0].where is "disk", not one of data, collective'),
    ({"kind": "slow", "seconds": 0, "steps": 2}, "faults[0].seconds is 0, not a number in (0, 600"),
    ({"kind": "slow", "seconds": 601, "steps": 2}, "faults[0].seconds is 601"),
    ({"kind": "slow", "seconds": True, "steps": 2}, "faults[0].seconds is true"),
    ({"kind": "slow", "seconds": 10**400, "steps": 2}, "faults[0].seconds is 1000000"),
    ({"kind": "slow", "seconds": 1, "steps": 0}, "faults[0].steps is 0, not an integer"),
])  # fmt: skip
def test_a_slow_or_stall_entry_out_of_its_contract_is_refused_naming_it(tmp_path, entry, said):
    path = plan_file(tmp_path, {"id": 0, "step": 1, "rank": 0, **entry})
    with pytest.raises(GoodputError) as refused:
        load(path)
    assert said in refused.value.what and refused.value.code == 2
