"""Fuzz the report's accounting over arbitrary run files: step lines with any times (overlapping,
going back, enormous), attempt records anywhere (overlapping, out of order, beyond any clock),
processes started by hand mixed with launched attempts, any checkpoints, done or not, any
``now``. The property holds on every input: every figure finite, 0 <= goodput <= 1, every cause
>= 0, productive time and causes adding up to the wall time; a record left out is named by a
line its file has. A well-formed run (the launcher's and trainer's own writers, some attempts
run by hand) leaves nothing out."""

import json
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput import rundir
from goodput.io import write_marker
from goodput.launch.history import AttemptRecord, append_record, timestamp
from goodput.report.accounting import account
from goodput.report.run_files import read_run
from goodput.testing.run_dirs import Attempt, write_run

T0 = 1_800_000_000.0
EXTREME_SECONDS = [0.0, 1e-9, 0.999, 4000.0, 1e7, 4e7, 1e300, sys.float_info.max]
seconds = st.floats(0, 30) | st.sampled_from(EXTREME_SECONDS)
instants = st.floats(-50, 200).map(lambda s: T0 + s) | st.sampled_from(
    [0.0, 1.0, 1e12, 1e300, sys.float_info.max]
)
step_lines = st.fixed_dictionaries(
    {"step": st.integers(0, 12), "time": instants, "step_time_s": seconds},
    optional={key: seconds for key in ("tokens_per_s", "data_time_s", "checkpoint_stall_s",
                                       "snapshot_stall_s", "checkpoint_load_s", "startup_s",
                                       "eval_time_s")},
)  # fmt: skip
# (start, length) from T0, in seconds: near, or decades off (before 1970, past MAX_INSTANT).
offsets = st.floats(-50, 200) | st.sampled_from([-2e9, -1e9, 1e10, 2e10])
lengths = st.floats(0, 100) | st.sampled_from([0.0, 4e7])
attempt_records = st.tuples(
    offsets,
    lengths,
    st.sampled_from([None, "1", "2"]),
    st.sampled_from(["success", "error", "hang"]),
)


def attempt_record(start: float, length: float, job: str | None, class_: str) -> AttemptRecord:
    """A stop record of an attempt of ``length`` s from ``T0 + start`` with no step seen."""
    return AttemptRecord(
        attempt=1, of=None, job=job, class_=class_,  # type: ignore[arg-type]
        exit_code={"success": 0, "error": 1, "hang": 124}[class_], timed_out=class_ == "hang",
        first_failure_label=None, started=_at(T0 + start), first_step_at=None,
        ended=_at(T0 + start + length), steps_seen=0, first_step=None, last_step=None,
        steps_gained=0, hosts=("nid0001",), evidence=(), replaced={}, spares_left=(),
        decision="stop", reason="done", wait_s=None,
    )  # fmt: skip


def _at(instant: float) -> str:
    return timestamp(datetime.fromtimestamp(instant, UTC))


def check_invariants(run_dir: Path, now: float | None) -> list:
    """The account of ``run_dir`` keeps every invariant; its records left out."""
    run = read_run(run_dir)
    acc = account(run, now=now)
    data = json.loads(json.dumps(acc.as_json(), allow_nan=False))  # finite, plain JSON
    assert 0 <= acc.goodput <= 1 and 0 <= acc.token_goodput <= 1
    assert data["goodput"] == acc.goodput and acc.wall_s >= 0
    assert acc.productive_s >= 0 and all(s >= 0 for s in acc.badput_s.values())
    total = acc.productive_s + sum(acc.badput_s.values())
    # Each cause is a sum of differences of instants: a few ulps of the instants each.
    magnitude = max(1.0, abs(acc.start), abs(acc.end))
    tolerance = 8e-15 * (len(run.steps) + len(run.attempts) + 4) * magnitude
    assert abs(total - acc.wall_s) <= tolerance, (total, acc.wall_s)
    lines = {
        str(run_dir / rundir.METRICS): len(run.steps),
        str(run_dir / rundir.ATTEMPTS): len(run.attempts),
    }
    for record in acc.ignored:
        assert 1 <= record.line <= lines[record.file] and record.why
    assert data["ignored_total"] == len(acc.ignored)
    return acc.ignored


@given(
    st.lists(step_lines, max_size=10),
    st.lists(attempt_records, max_size=4),
    st.lists(st.integers(1, 12), max_size=3),
    st.booleans(),
    st.none() | instants,
)
def test_any_run_files_keep_the_invariants(steps, attempts, checkpoints, done, now):
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch)
        lines = "".join(json.dumps(line) + "\n" for line in steps)
        (run_dir / rundir.METRICS).write_text(lines)
        for attempt in attempts:
            append_record(run_dir / rundir.ATTEMPTS, attempt_record(*attempt))
        for step in checkpoints:
            write_marker(rundir.step_dir(rundir.checkpoints_dir(run_dir), step))
        if done:
            write_marker(run_dir, rundir.DONE)
        check_invariants(run_dir, now)


well_formed_attempts = st.lists(
    st.tuples(
        st.floats(0, 50),  # the gap before it
        st.floats(0, 10),  # start-up
        st.integers(0, 4),  # steps
        st.floats(0.001, 5),  # step time
        st.floats(0, 5),  # tail
        st.booleans(),  # launched (a record) or by hand (none)
        st.sampled_from(["1", "2"]),
    ),
    min_size=1,
    max_size=5,
)


@given(well_formed_attempts, st.booleans(), st.none() | st.floats(0, 1000).map(lambda s: T0 + s))
def test_hand_and_launched_attempts_mixed(shapes, done, now):
    """As the trainer and the launcher write them, some attempts run by hand (no record), each
    resuming one step back (a recomputed step): nothing is left out, and the invariants hold."""
    attempts, launched, clock, first = [], [], T0, 1
    for gap, startup, num_steps, step_time, tail, was_launched, job in shapes:
        attempt = Attempt(
            start=clock + gap, startup_s=startup, steps=range(first, first + num_steps),
            step_time_s=step_time, tail_s=tail, job=job, data_time_s=step_time / 4,
        )  # fmt: skip
        attempts.append(attempt)
        launched.append(was_launched)
        clock, first = attempt.end(), max(first, first + num_steps - 1)
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch)
        write_run(run_dir, attempts, checkpoints=[first], done=done)
        records = (run_dir / rundir.ATTEMPTS).read_text().splitlines(keepends=True)
        kept = [line for line, keep in zip(records, launched, strict=True) if keep]
        (run_dir / rundir.ATTEMPTS).write_text("".join(kept))
        if not any(attempt.steps for attempt in attempts) and not kept:
            (run_dir / rundir.ATTEMPTS).unlink()
            (run_dir / rundir.METRICS).write_text('{"step": 1, "time": 1, "step_time_s": 1}\n')
        assert check_invariants(run_dir, now) == []
