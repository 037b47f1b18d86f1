"""The straggler watch on synthetic busy times (what every rank computes from the shared vote),
and the busy clock against the beacon's collective waits."""

from __future__ import annotations

import time

import pytest

from goodput import beacon, rundir
from goodput.checkpoint.save import Decision
from goodput.errors import ExitCode
from goodput.ranks import EVICT_VAR
from goodput.runfiles import HostBusy, read_busy
from goodput.stragglers_line import parse_notice
from goodput.train.config.run import WatchConfig
from goodput.train.monitor.stragglers import BusyClock, StragglerWatch

HOSTS = ["nid1", "nid1", "nid2", "nid2"]


def watch(tmp_path, hosts=HOSTS, rank=0, ratio=1.2, steps=5) -> StragglerWatch:
    cfg = WatchConfig(straggler_ratio=ratio, straggler_steps=steps)
    return StragglerWatch(cfg, hosts, rank=rank, run_dir=tmp_path)


def run(watched, shares_of_step, first=0, last=10) -> dict[int, dict]:
    """Steps ``first``..``last``; the process's first (step 0 here) is warm-up, never judged."""
    return {step: watched.observe(step, shares_of_step(step)) for step in range(first, last + 1)}


def warnings(text: str) -> list:
    return [parse_notice(line) for line in text.splitlines() if "warning: straggler:" in line]


def test_a_slow_rank_is_named_once_with_its_host_ratio_and_window(tmp_path, capsys):
    watched = watch(tmp_path)
    fields = run(watched, lambda step: [0.10, 0.10, 0.15, 0.10], last=15)
    (notice,) = warnings(capsys.readouterr().out)  # three windows, one line
    assert (notice.rank, notice.host, notice.first_step, notice.last_step) == (2, "nid2", 1, 5)
    assert (notice.ratio, notice.busy_s, notice.median_s) == (1.5, 0.15, 0.1)
    assert watched.named is not None and watched.named.rank == 2
    assert fields[3] == {
        "busy_s_min": 0.10,
        "busy_s_median": 0.10,
        "busy_s_max": 0.15,
        "busy_slowest_rank": 2,
        "busy_slowest_host": "nid2",
    }
    assert fields[5]["straggler_rank"] == 2 and fields[5]["straggler_ratio"] == pytest.approx(1.5)
    assert not any("straggler_rank" in fields[step] for step in (4, 6, 10, 15))
    windows = list(read_busy(tmp_path / rundir.BUSY))
    assert [(w.step, w.steps) for w in windows] == [(5, 5), (10, 5), (15, 5)]
    assert windows[0].hosts == (
        HostBusy("nid1", 0.10, 0.10, 0.10),
        HostBusy("nid2", pytest.approx(0.125), 0.10, 0.15),
    )


def test_the_first_step_of_a_process_is_warm_up_and_never_judged(tmp_path, capsys):
    # Rank 1's first step is 10x the others' (allocations, its data loader's start): a window
    # that held it would name rank 1 at 2.8x; the first window is steps 2-6 instead.
    watched = watch(tmp_path, hosts=["a", "b"])
    fields = run(watched, lambda step: [0.1, 1.0 if step == 1 else 0.1], first=1, last=6)
    assert warnings(capsys.readouterr().out) == [] and watched.named is None
    assert fields[1]["busy_slowest_rank"] == 1  # recorded all the same
    assert [w.step for w in read_busy(tmp_path / rundir.BUSY)] == [6]


def test_the_median_of_two_ranks_is_their_mean(tmp_path, capsys):
    run(watch(tmp_path, hosts=["a", "b"]), lambda step: [0.1, 0.2])
    notices = warnings(capsys.readouterr().out)
    assert [(n.rank, n.ratio) for n in notices] == [(1, 1.33)]  # 0.2 over 0.15


def test_the_median_of_four_ranks_and_every_rank_past_the_ratio_once(tmp_path, capsys):
    fields = run(watch(tmp_path), lambda step: [0.1, 0.1, 0.3, 0.5])
    assert fields[1]["busy_s_median"] == pytest.approx(0.2)  # the middle two's mean
    notices = warnings(capsys.readouterr().out)
    assert [(n.rank, n.ratio) for n in notices] == [(3, 2.5), (2, 1.5)]
    assert fields[5]["straggler_rank"] == 3  # the worst, on the window's step


@pytest.mark.parametrize("slow", [0.119, 0.12])  # just below the ratio, and at it: not past it
def test_no_line_at_or_below_the_ratio(tmp_path, capsys, slow):
    fields = run(watch(tmp_path), lambda step: [0.1, 0.1, 0.1, slow])
    assert warnings(capsys.readouterr().out) == []
    assert not any("straggler_rank" in f for f in fields.values())


def test_a_straggler_is_judged_by_its_window_means(tmp_path, capsys):
    # Slow only in the second window, and by one long step: the window's mean counts.
    run(watch(tmp_path), lambda step: [0.1, 0.1, 0.1, 0.4 if step == 8 else 0.1])
    (notice,) = warnings(capsys.readouterr().out)
    assert (notice.rank, notice.first_step, notice.last_step) == (3, 6, 10)
    assert notice.ratio == 1.6  # (4 x 0.1 + 0.4) / 5 = 0.16 over 0.1


def test_a_rank_is_named_again_only_after_a_window_back_under_the_ratio(tmp_path, capsys):
    # Slow in windows 1, 2 and 4; window 3 (steps 11-15) is back at the median.
    def shares(step):
        return [0.1, 0.1, 0.1, 0.1 if 11 <= step <= 15 else 0.2]

    watched = watch(tmp_path)
    run(watched, shares, last=20)
    notices = warnings(capsys.readouterr().out)
    assert [(n.rank, n.first_step, n.last_step) for n in notices] == [(3, 1, 5), (3, 16, 20)]
    assert watched.named == notices[0]  # eviction acts on the first


def test_every_rank_holds_the_state_and_only_rank_0_speaks(tmp_path, capsys):
    watched = watch(tmp_path, rank=1)
    run(watched, lambda step: [0.1, 0.1, 0.3, 0.1])
    assert capsys.readouterr().out == ""
    assert not (tmp_path / rundir.BUSY).exists()
    assert watched.named is not None and watched.named.rank == 2


def test_one_rank_records_its_busy_time_and_judges_nothing(tmp_path, capsys):
    fields = run(watch(tmp_path, hosts=["a"]), lambda step: [0.2])
    assert fields[5] == {
        "busy_s_min": 0.2,
        "busy_s_median": 0.2,
        "busy_s_max": 0.2,
        "busy_slowest_rank": 0,
        "busy_slowest_host": "a",
    }
    assert capsys.readouterr().out == "" and not (tmp_path / rundir.BUSY).exists()


def test_eviction_needs_the_variable_a_straggler_and_a_periodic_save(tmp_path):
    watched = watch(tmp_path, hosts=["a", "b"])
    assert not watched.evicts(Decision.PERIODIC, {EVICT_VAR: "1"})  # no straggler yet
    run(watched, lambda step: [0.1, 0.3])
    assert watched.evicts(Decision.PERIODIC, {EVICT_VAR: "1"})
    assert not watched.evicts(Decision.PERIODIC, {})
    assert not watched.evicts(Decision.PERIODIC, {EVICT_VAR: "0"})
    for decision in (Decision.NONE, Decision.FINAL, Decision.STOP):
        assert not watched.evicts(decision, {EVICT_VAR: "1"})
    error = watched.evicted(20)
    assert error.code == ExitCode.STRAGGLER == 4
    assert "stopping after the save of step 20 to replace straggler rank 1 on b" in error.render()


def test_busy_time_leaves_out_collective_waits_and_what_is_timed_apart():
    clock = BusyClock()
    clock.start()
    time.sleep(0.05)  # busy
    with beacon.current().collective("step.tokens"):
        time.sleep(0.3)  # waiting for the peers
    with clock.apart(), beacon.current().collective("eval.sums"):
        time.sleep(0.3)  # the eval, and its own wait (counted once)
    assert 0.05 <= clock.seconds() < 0.25
