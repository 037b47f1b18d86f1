"""The launcher's side of in-process recovery (``goodput.launch.inprocess``) against its real
recovery store (torch's TCPStore) and real child processes standing in for the ranks: the
ranks' keys are set by this test as ``goodput.train.recovery`` sets them (its own tests and
tests/chaos/test_chaos_in_process.py run the real ranks). Each path of the issue: a recovery,
and each fallback — no warm spare, a second failure, a spare that fails, ranks that never leave
their step."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from goodput.cli import main
from goodput.launch.inprocess import Fallback, InProcess, Recovered
from goodput.ranks import RECOVERY_STORE_VAR, SPARE_VAR, parse_store_address


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.fixture
def processes():
    started: list[subprocess.Popen[bytes]] = []

    def start(count: int) -> list[subprocess.Popen[bytes]]:
        new = [sleeper() for _ in range(count)]
        started.extend(new)
        return new

    yield start
    for process in started:
        process.kill()
        process.wait()


def act_as_ranks(recovery: InProcess, keys: list[str], delay_s: float = 0.05) -> threading.Thread:
    """Set ``keys`` after ``delay_s``, as the ranks would, from a client of their own."""
    import torch.distributed as dist

    host, port = parse_store_address(recovery.rank_env()[RECOVERY_STORE_VAR])

    def run() -> None:
        client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False)
        time.sleep(delay_s)
        for key in keys:  # as a rank says it: its own key, and its count in the step's
            client.set(key, "1")
            client.add(key.rpartition("/")[0], 1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_death_is_recovered_with_a_warm_spare_in_a_new_generation(processes):
    recovery = InProcess(spares_warm=1, timeout_s=30)
    ranks = processes(4)
    (spare,) = processes(1)
    number, env = recovery.spare_env({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4"})
    assert env[SPARE_VAR] == str(number) and "RANK" not in env and "LOCAL_RANK" not in env
    recovery.spares[number] = spare
    ranks[2].kill()
    ranks[2].wait()
    survivors = [0, 1, 3]
    rank_keys = [f"left/0/{r}" for r in survivors] + [f"joined/1/{r}" for r in range(4)]
    act_as_ranks(recovery, rank_keys)
    notices: list[str] = []
    outcome = recovery.recover(2, ranks, notices.append)
    assert isinstance(outcome, Recovered), outcome
    assert (outcome.rank, outcome.spare, outcome.generation) == (2, number, 1)
    assert ranks[2] is spare and recovery.generation == 1 and not recovery.spares
    assert outcome.abort_s >= 0 and outcome.rendezvous_s >= 0
    store = recovery.store
    assert json.loads(store.get(f"spare/{number}")) == {"rank": 2, "generation": 1}
    assert json.loads(store.get("next/0")) == {"generation": 1}
    assert all(store.get(f"wake/0/{r}") == b"abort" for r in range(4))
    assert "spare 0 takes its place" in notices[0]


def test_without_a_warm_spare_every_rank_is_told_to_fall_back(processes):
    recovery = InProcess(spares_warm=0, timeout_s=30)
    ranks = processes(2)
    outcome = recovery.recover(1, ranks, lambda _: None)
    assert isinstance(outcome, Fallback) and outcome.why == "no warm spare is alive"
    assert json.loads(recovery.store.get("next/0")) == {"fallback": "no warm spare is alive"}
    assert recovery.generation == 0


def test_a_spare_that_died_is_no_spare(processes):
    recovery = InProcess(spares_warm=1, timeout_s=30)
    ranks = processes(2)
    (spare,) = processes(1)
    spare.kill()
    spare.wait()
    recovery.spares[0] = spare
    outcome = recovery.recover(1, ranks, lambda _: None)
    assert isinstance(outcome, Fallback) and outcome.why == "no warm spare is alive"


@pytest.mark.parametrize("who", ["survivor", "spare"])
def test_a_second_failure_during_the_recovery_falls_back(processes, who):
    recovery = InProcess(spares_warm=1, timeout_s=30)
    ranks = processes(3)
    (spare,) = processes(1)
    recovery.spares[0] = spare
    second = ranks[0] if who == "survivor" else spare
    threading.Timer(0.2, second.kill).start()
    outcome = recovery.recover(1, ranks, lambda _: None)
    assert isinstance(outcome, Fallback), outcome
    assert outcome.why.startswith("a second failure during the recovery"), outcome.why
    assert "fallback" in json.loads(recovery.store.get("next/0"))
    assert spare.wait(10) is not None  # the spare given the rank is stopped too


def test_ranks_that_never_leave_their_step_fall_back_after_the_timeout(processes):
    recovery = InProcess(spares_warm=1, timeout_s=0.5)
    ranks = processes(3)
    (spare,) = processes(1)
    recovery.spares[0] = spare
    act_as_ranks(recovery, ["left/0/0"])  # rank 2 never leaves
    started = time.monotonic()
    outcome = recovery.recover(1, ranks, lambda _: None)
    assert isinstance(outcome, Fallback)
    assert outcome.why == "1 rank(s) did not leave its step within 0.5 s (left/0/2)"
    assert time.monotonic() - started < 10


def test_ranks_that_never_join_the_new_generation_fall_back(processes):
    recovery = InProcess(spares_warm=1, timeout_s=0.5)
    ranks = processes(2)
    (spare,) = processes(1)
    recovery.spares[0] = spare
    act_as_ranks(recovery, ["left/0/0", "joined/1/0"])
    outcome = recovery.recover(1, ranks, lambda _: None)
    assert isinstance(outcome, Fallback)
    assert outcome.why == "1 rank(s) did not join generation 1 within 0.5 s (joined/1/1)"
    assert "fallback" in json.loads(recovery.store.get("next/1"))


def test_warm_spares_without_in_process_is_a_usage_error(capsys):
    assert main(["launch", "--spares-warm", "1", "--", "goodput", "train", "run.toml"]) == 2
    assert capsys.readouterr().err.strip() == (
        "goodput: error: --spares-warm: keeps spares for in-process recovery; add --in-process"
    )


def test_under_srun_in_process_says_it_falls_back_to_full_restarts(capsys, monkeypatch):
    """srun's one step owns every rank (a dry run: no job is started, none is needed)."""
    monkeypatch.setenv("SLURM_JOB_ID", "812")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "nid[001-002]")
    argv = ["launch", "--dry-run", "--retries", "1", "--in-process", "--spares-warm", "1"]
    assert main([*argv, "--", "goodput", "train", "run.toml"]) == 0
    err = capsys.readouterr().err
    assert "--in-process needs the local launcher in this version (this is slurm)" in err


def test_a_signal_to_the_launcher_ends_the_wait_at_once(processes):
    recovery = InProcess(spares_warm=1, timeout_s=30)
    ranks = processes(2)
    (spare,) = processes(1)
    recovery.spares[0] = spare
    started = time.monotonic()
    outcome = recovery.recover(1, ranks, lambda _: None, interrupted=lambda: True)
    assert isinstance(outcome, Fallback) and outcome.why == "the launcher was interrupted"
    assert time.monotonic() - started < 5


def test_the_commands_recovery_timeout_is_the_launchers_default():
    from goodput.commands import launch
    from goodput.launch.inprocess import DEFAULT_TIMEOUT_S

    parsed, _ = launch.parse(["--in-process", "--", "goodput", "train", "run.toml"])
    assert launch.options(parsed).recovery_timeout_s == DEFAULT_TIMEOUT_S
