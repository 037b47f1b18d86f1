"""Fuzz a chaos campaign's report over hostile run files: attempts that fail anywhere, with any
waits, step lines with any times added (overlapping, going back, enormous) and faults that fired
at any time (before the run, between attempts, after it) of any kind.

Properties: the campaign reads the run as ``goodput report`` does (its goodput is that account's:
every cause >= 0), every per-fault figure is None or finite and >= 0 (the old accounting's
``other`` went negative on such files), and the whole report formats and writes as plain JSON.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput import rundir
from goodput.chaos import campaign, outcomes
from goodput.chaos.records import FiredRecord
from goodput.chaos.report import Report, format_report
from goodput.faults import KINDS, Fault
from goodput.testing.run_dirs import Attempt, write_run

T0 = 1_800_000_000.0
FIGURES = ("at_s", "detection_s", "backoff_s", "startup_s", "load_s", "first_step_s",
           "recovery_s", "steps_lost")  # fmt: skip

attempt_shapes = st.lists(
    st.tuples(
        st.floats(0, 20),  # the gap before it
        st.floats(0, 5),  # start-up
        st.integers(0, 4),  # steps
        st.floats(0.001, 3),  # step time
        st.floats(0, 0.5),  # checkpoint load
        st.floats(0, 3),  # tail
        st.sampled_from(["error", "hang", "success"]),
        st.floats(0, 10),  # wait after it (a retry)
    ),
    min_size=2,  # a failure, and the attempt after it
    max_size=4,
)
seconds = st.floats(0, 30) | st.sampled_from([0.0, 4000.0, 1e7, 1e300, sys.float_info.max])
instants = st.floats(-50, 200).map(lambda s: T0 + s) | st.sampled_from([0.0, 1e12, 1e300])
step_lines = st.fixed_dictionaries(
    {"step": st.integers(0, 12), "time": instants, "step_time_s": seconds},
    optional={key: seconds for key in ("checkpoint_load_s", "startup_s", "eval_time_s")},
)
# When a fault fired: a fraction of the run's wall time from its start (before, in, after it),
# or an instant far off.
fired_at = st.floats(-0.2, 1.2) | st.sampled_from([-1e9, 1e300])


def _attempts(shapes: list[tuple]) -> list[Attempt]:
    """The launcher's records and the trainer's lines of ``shapes``, each resuming one step
    back; the last attempt is a stop (no wait)."""
    attempts, clock, first = [], T0, 1
    for index, (gap, startup, num_steps, step_time, load, tail, class_, wait) in enumerate(shapes):
        last = index == len(shapes) - 1
        attempt = Attempt(
            start=clock + gap, startup_s=startup + load, checkpoint_load_s=load,
            steps=range(first, first + num_steps), step_time_s=step_time, tail_s=tail,
            class_=class_, exit_code={"success": 0, "error": 137, "hang": 124}[class_],
            timed_out=class_ == "hang", wait_s=None if last else wait,
        )  # fmt: skip
        attempts.append(attempt)
        clock, first = attempt.end() + (0 if last else wait), max(first, first + num_steps - 1)
    return attempts


def _instant(start: float, wall_s: float, at: float) -> float:
    return start + at * wall_s if abs(at) <= 2 else at


@given(
    attempt_shapes,
    st.lists(step_lines, max_size=4),
    st.lists(st.tuples(st.sampled_from(KINDS), fired_at), min_size=1, max_size=4),
    st.booleans(),
    st.integers(0, 3),
)
def test_any_run_gives_a_report_of_finite_figures_none_negative(shapes, extra, fired, done, k):
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch)
        write_run(run_dir, _attempts(shapes), checkpoints=[1], done=done)
        with (run_dir / rundir.METRICS).open("a") as metrics:
            metrics.writelines(json.dumps(line) + "\n" for line in extra)
        run = campaign.account_run(run_dir)
    acc = run.accounting
    assert acc.productive_s >= 0 and all(s >= 0 for s in acc.badput_s.values())
    planned = [Fault(i, kind, 1, 0) for i, (kind, _) in enumerate(fired)] + [Fault(9, "kill", 2, 0)]
    records = [
        FiredRecord(i, kind, 1, 0, max(0.0, _instant(acc.start, acc.wall_s, at)))
        for i, (kind, at) in enumerate(fired)
    ]
    found = outcomes.fault_outcomes(planned, records, acc.timeline, ranks_per_host=1)
    for outcome in found:
        for name in FIGURES:
            value = getattr(outcome, name)
            assert value is None or (math.isfinite(value) and value >= 0), (name, value)
    report = Report(
        config="run.toml", output="report.json", seed=0, num_ranks=2, kinds=KINDS, notes=(),
        idle_timeout_s=10.0, memory_interval_steps=k, faults=tuple(found),
        attempts=tuple(run.files.attempts),
        faulted=acc, reference=acc, unfinished=None, comparison=None,
    )  # fmt: skip
    assert f"goodput {acc.goodput:.1%}" in format_report(report)
    # The <= k verdict holds exactly the faults that ended an attempt and lost more than k.
    over = [o for o in found if k and o.steps_lost is not None and o.steps_lost > k
            and o.fault.kind in outcomes.ENDS_ATTEMPT]  # fmt: skip
    assert report.lost_too_many == over
    json.dumps(report.to_json(), allow_nan=False)  # plain JSON: every figure finite
