"""The straggler watch on synthetic busy times, every rank a thread exchanging through the step's
real vote (``goodput.testing.wire``), and the busy clock against the beacon's collective waits."""

from __future__ import annotations

import time

import pytest

from goodput import beacon, rundir
from goodput.checkpoint.save import Decision
from goodput.errors import ExitCode
from goodput.ranks import EVICT_VAR
from goodput.runfiles import SLOWEST, RankBusy, read_busy
from goodput.stragglers_line import parse_notice
from goodput.testing.wire import in_lockstep
from goodput.train.config.run import WatchConfig
from goodput.train.monitor.spread import BINS
from goodput.train.monitor.stragglers import BusyClock, StragglerWatch
from goodput.train.step_vote import Ballot, cast

HOSTS = ["nid1", "nid1", "nid2", "nid2"]


def run(tmp_path, shares_of_step, *, hosts=HOSTS, ratio=1.2, steps=5, first=0, last=10):
    """Steps ``first``..``last`` on ``len(hosts)`` ranks in lockstep, each rank's busy time
    ``shares_of_step(step)[rank]`` through the step's real vote; the process's first step
    (step 0 here) is warm-up, never judged. Every rank's watch, and rank 0's fields by step."""
    cfg = WatchConfig(straggler_ratio=ratio, straggler_steps=steps)

    def rank_body(wire):
        watched = StragglerWatch(cfg, hosts, wire, run_dir=tmp_path)
        fields = {}
        for step in range(first, last + 1):
            busy_s = shares_of_step(step)[wire.rank]
            ballot = Ballot(sigterm=False, minutes_due=False, snapshot_ok=True, busy_s=busy_s)
            fields[step] = watched.observe(step, busy_s, cast(wire, ballot).busy)
        return watched, fields

    results, _ = in_lockstep(rank_body, len(hosts))
    return [watched for watched, _ in results], results[0][1]


def warnings(text: str) -> list:
    return [parse_notice(line) for line in text.splitlines() if "warning: straggler:" in line]


def test_a_slow_rank_is_named_once_with_its_host_ratio_and_window(tmp_path, capsys):
    watches, fields = run(tmp_path, lambda step: [0.10, 0.10, 0.15, 0.10], last=15)
    (notice,) = warnings(capsys.readouterr().out)  # three windows, one line
    assert (notice.rank, notice.host, notice.first_step, notice.last_step) == (2, "nid2", 1, 5)
    assert (notice.ratio, notice.busy_s, notice.median_s) == (1.5, 0.15, 0.1)
    assert all(w.named is not None and w.named.rank == 2 for w in watches)  # every rank knows
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
    assert [(w.step, w.steps, w.ranks) for w in windows] == [(5, 5, 4), (10, 5, 4), (15, 5, 4)]
    assert windows[0].quantiles == (0.10, 0.10, 0.10, pytest.approx(0.1125), 0.15)
    assert windows[0].slowest == (
        RankBusy(2, "nid2", 0.15),
        *(RankBusy(rank, host, 0.10) for rank, host in [(0, "nid1"), (1, "nid1"), (3, "nid2")]),
    )


def test_the_first_step_of_a_process_is_warm_up_and_never_judged(tmp_path, capsys):
    # Rank 1's first step is 10x the others' (allocations, its data loader's start): a window
    # that held it would name rank 1 at 2.8x; the first window is steps 2-6 instead.
    watches, fields = run(
        tmp_path, lambda step: [0.1, 1.0 if step == 1 else 0.1], hosts=["a", "b"], first=1, last=6
    )
    assert warnings(capsys.readouterr().out) == [] and watches[0].named is None
    assert fields[1]["busy_slowest_rank"] == 1  # recorded all the same
    assert [w.step for w in read_busy(tmp_path / rundir.BUSY)] == [6]


def test_the_median_of_two_ranks_is_their_mean(tmp_path, capsys):
    run(tmp_path, lambda step: [0.1, 0.2], hosts=["a", "b"])
    notices = warnings(capsys.readouterr().out)
    assert [(n.rank, n.ratio) for n in notices] == [(1, 1.33)]  # 0.2 over 0.15


def test_the_median_of_four_ranks_and_every_rank_past_the_ratio_once(tmp_path, capsys):
    _, fields = run(tmp_path, lambda step: [0.1, 0.1, 0.3, 0.5])
    assert fields[1]["busy_s_median"] == pytest.approx(0.2)  # the middle two's mean
    notices = warnings(capsys.readouterr().out)
    assert [(n.rank, n.ratio) for n in notices] == [(3, 2.5), (2, 1.5)]
    assert fields[5]["straggler_rank"] == 3  # the worst, on the window's step


@pytest.mark.parametrize("slow", [0.119, 0.12])  # just below the ratio, and at it: not past it
def test_no_line_at_or_below_the_ratio(tmp_path, capsys, slow):
    _, fields = run(tmp_path, lambda step: [0.1, 0.1, 0.1, slow])
    assert warnings(capsys.readouterr().out) == []
    assert not any("straggler_rank" in f for f in fields.values())


def test_a_straggler_is_judged_by_its_window_means(tmp_path, capsys):
    # Slow only in the second window, and by one long step: the window's mean counts.
    run(tmp_path, lambda step: [0.1, 0.1, 0.1, 0.4 if step == 8 else 0.1])
    (notice,) = warnings(capsys.readouterr().out)
    assert (notice.rank, notice.first_step, notice.last_step) == (3, 6, 10)
    assert notice.ratio == 1.6  # (4 x 0.1 + 0.4) / 5 = 0.16 over 0.1


def test_a_rank_is_named_again_only_after_a_window_back_under_the_ratio(tmp_path, capsys):
    # Slow in windows 1, 2 and 4; window 3 (steps 11-15) is back at the median.
    def shares(step):
        return [0.1, 0.1, 0.1, 0.1 if 11 <= step <= 15 else 0.2]

    watches, _ = run(tmp_path, shares, last=20)
    notices = warnings(capsys.readouterr().out)
    assert [(n.rank, n.first_step, n.last_step) for n in notices] == [(3, 1, 5), (3, 16, 20)]
    assert all(w.named == notices[0] for w in watches)  # eviction acts on the first


def test_only_rank_0_speaks_and_writes(tmp_path, capsys):
    run(tmp_path, lambda step: [0.1, 0.1, 0.3, 0.1])
    out = capsys.readouterr().out
    assert len(warnings(out)) == 1 and out.count("straggler:") == 1  # one rank printed it
    assert len(list(read_busy(tmp_path / rundir.BUSY))) == 2  # one line a window, not four


def test_one_rank_records_its_busy_time_and_judges_nothing(tmp_path, capsys):
    _, fields = run(tmp_path, lambda step: [0.2], hosts=["a"])
    assert fields[5] == {
        "busy_s_min": 0.2,
        "busy_s_median": 0.2,
        "busy_s_max": 0.2,
        "busy_slowest_rank": 0,
        "busy_slowest_host": "a",
    }
    assert capsys.readouterr().out == "" and not (tmp_path / rundir.BUSY).exists()


def test_a_world_past_the_slowest_names_the_worst_and_counts_the_rest(tmp_path, capsys):
    """64 ranks, 12 of them slow by their rank: the SLOWEST slowest are named, slowest first,
    the rest counted; the busy line keeps the spread and the slowest, not 64 rows."""
    world = 64
    hosts = [f"nid{rank // 4:03d}" for rank in range(world)]
    slow = {rank: 0.2 + rank / 1000 for rank in range(0, world, 5)[:12]}
    watches, _ = run(tmp_path, lambda step: [slow.get(r, 0.1) for r in range(world)], hosts=hosts)
    out = capsys.readouterr().out
    named = [n.rank for n in warnings(out)]
    assert named == sorted(slow, reverse=True)[:SLOWEST]
    assert f"warning: {len(slow) - SLOWEST} more ranks past 1.2x" in out
    assert all(w.named is not None and w.named.rank == named[0] for w in watches)
    window = next(read_busy(tmp_path / rundir.BUSY))
    assert [row.rank for row in window.slowest] == named
    assert window.quantiles[0] == 0.1 and window.quantiles[2] == 0.1
    assert window.quantiles[4] == max(slow.values()) and window.ranks == world


def test_the_vote_sends_the_same_integers_at_any_world_size(tmp_path):
    """What each rank sends over 4 steps and a window, counted: equal at 2, 4 and 64 ranks."""

    def sent(world):
        def body(wire):
            cfg = WatchConfig(straggler_steps=2)  # step 0 warm-up, a window of steps 1-2
            watched = StragglerWatch(cfg, ["h"] * world, wire, run_dir=tmp_path)
            for step in range(4):
                ballot = Ballot(sigterm=False, minutes_due=False, snapshot_ok=True, busy_s=0.1)
                watched.observe(step, 0.1, cast(wire, ballot).busy)

        _, reduces = in_lockstep(body, world)
        return sorted((op, size) for rank, op, size in reduces if rank == 0)

    assert sent(2) == sent(4) == sent(64)
    per_step = [("max", 2), ("sum", 3 + 2 * BINS)]
    window = [("max", 3)] * SLOWEST + [("sum", 2 * BINS + 1)]
    assert sent(2) == sorted(per_step * 4 + window)


def test_eviction_needs_the_variable_a_straggler_and_a_periodic_save(tmp_path):
    (watched, _), _ = run(tmp_path, lambda step: [0.1, 0.3], hosts=["a", "b"], last=0)
    assert not watched.evicts(Decision.PERIODIC, {EVICT_VAR: "1"})  # no straggler yet
    (watched, _), _ = run(tmp_path, lambda step: [0.1, 0.3], hosts=["a", "b"])
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
