"""Fuzz the chaos plan drawer (``chaos.plan.draw_faults``) over any kinds, counts, run lengths,
intervals, ranks and watch windows: a usage error naming ``--faults``, or a plan in which each
``slow`` fault owns a window before the last step that no other fault enters, far enough from
the next for a whole watch window between them, the save faults sit on distinct saves, the
snapshot faults on distinct snapshots, every step is distinct, stalls are dealt evenly between
data and collective, and the plan, once timed, is one the trainer reads back exactly."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.chaos import plan
from goodput.errors import GoodputError
from goodput.faults import IN_SAVE, IN_SNAPSHOT, KINDS, load_plan


@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=len(KINDS), unique=True),
    num_faults=st.integers(1, 30),
    num_steps=st.integers(1, 400),
    interval=st.integers(0, 50),
    num_ranks=st.integers(1, 8),
    straggler_steps=st.integers(2, 30),
    seed=st.integers(0, 2**32),
    snapshots=st.integers(0, 20),
)
def test_any_draw_is_a_plan_within_bounds_or_a_usage_error(
    kinds, num_faults, num_steps, interval, num_ranks, straggler_steps, seed, snapshots
):
    dealt = plan.deal_kinds(num_faults, kinds, seed)
    try:
        faults = plan.draw_faults(
            dealt, num_steps=num_steps, interval_steps=interval, num_ranks=num_ranks,
            seed=seed, straggler_steps=straggler_steps, snapshot_interval_steps=snapshots,
        )  # fmt: skip
    except GoodputError as error:
        assert error.where == "--faults" and error.code == 2
        return
    assert sorted(f.kind for f in faults) == sorted(dealt)
    assert [f.id for f in faults] == list(range(num_faults))
    steps = [f.step for f in faults]
    assert steps == sorted(set(steps)) and all(1 <= s < num_steps for s in steps)
    assert all(0 <= f.rank < num_ranks for f in faults)
    window = straggler_steps + 5
    windows = [range(f.step, f.step + window) for f in faults if f.kind == "slow"]
    assert all(f.steps == window for f in faults if f.kind == "slow")
    assert all(w[-1] < num_steps for w in windows)
    for fault in faults:  # a slow fault's own window holds it, and no other fault
        assert sum(fault.step in w for w in windows) == (fault.kind == "slow")
    # Between two windows, room for a whole watch window of steps.
    quiet = 2 * straggler_steps - 1
    assert all(b.start - a.stop >= quiet for a, b in zip(windows, windows[1:], strict=False))
    saves = [f.step for f in faults if f.kind in IN_SAVE]
    assert all(s in plan.save_steps(num_steps, interval) for s in saves)
    snaps = [f.step for f in faults if f.kind in IN_SNAPSHOT]
    assert all(s in plan.snapshot_steps(num_steps, snapshots) for s in snaps)
    wheres = Counter(f.where for f in faults if f.kind == "stall")
    assert set(wheres) <= {"data", "collective"} and abs(wheres["data"] - wheres["collective"]) <= 1
    timed = plan.timed(faults, 0.125)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "plan.json"
        plan.write_plan(path, timed, Path(scratch) / "fired")
        loaded = load_plan({"GOODPUT_FAULTS": str(path)})
    assert loaded is not None and loaded.faults == timed
