"""In-memory checkpoints in the report: a snapshot's stall is its own cause (``snapshot``), charged
as the checkpoint save's is, its seconds in a step run again lost with the step; each attempt says
where its process loaded its state from (its own snapshot, its partner's copy, a checkpoint), in
``--json``, the terminal summary and the page (checked in headless Chromium as test_html.py
does); a source the trainer does not write is refused as a damaged line."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from goodput import rundir
from goodput.errors import GoodputError
from goodput.report.accounting import account
from goodput.report.html import render_html
from goodput.report.run_files import read_run
from goodput.report.terminal import summary
from goodput.testing.run_dirs import Attempt, write_run

T0 = 1_800_000_000.0
STALL = 0.25  # each snapshot's (k = 2: after every even step)


def snapshots(steps: range) -> dict[int, float]:
    return {step: STALL for step in steps if step % 2 == 0}


# Killed after step 6 -> its own snapshot of step 6; its host lost after step 11 (the snapshot
# of 10 settled, 11's step lost) -> its partner's copy of 10; killed after 14 with every
# snapshot damaged -> the disk checkpoint of step 10.
KILLED = Attempt(
    start=T0, startup_s=5, steps=range(1, 7), snapshot_stalls=snapshots(range(1, 7)),
    tail_s=1, class_="error", exit_code=1, job="9", wait_s=2,
)  # fmt: skip
HOST_LOST = Attempt(
    start=KILLED.end() + 2, startup_s=3, steps=range(7, 12), stalls={10: 0.5},
    snapshot_stalls=snapshots(range(7, 12)), resumed=("snapshot", 6), tail_s=1,
    class_="bad-node", exit_code=1, job="9", wait_s=2, replaced={"nid0001": "nid0002"},
)  # fmt: skip
DAMAGED = Attempt(
    start=HOST_LOST.end() + 2, startup_s=3, steps=range(11, 15),
    snapshot_stalls=snapshots(range(11, 15)), resumed=("partner", 10), tail_s=1,
    class_="error", exit_code=1, job="9", wait_s=2, host="nid0002",
)  # fmt: skip
DONE = Attempt(
    start=DAMAGED.end() + 2, startup_s=4, checkpoint_load_s=2, steps=range(11, 17),
    snapshot_stalls=snapshots(range(11, 17)), resumed=("checkpoint", 10), job="9",
    host="nid0002",
)  # fmt: skip
SOURCES = [(None, None), ("snapshot", 6), ("partner", 10), ("checkpoint", 10)]


@pytest.fixture
def run(tmp_path):
    write_run(tmp_path, [KILLED, HOST_LOST, DAMAGED, DONE], checkpoints=(10, 16), done=True)
    files = read_run(tmp_path)
    return files, account(files)


def test_snapshot_stalls_are_their_own_cause(run):
    _, acc = run
    # Kept: steps 1-6 of the first attempt, 7-10 of the second, 11-16 of the last: 8 snapshots.
    assert acc.badput_s["snapshot"] == pytest.approx(8 * STALL)
    assert acc.badput_s["checkpoint_save"] == pytest.approx(0.5)  # step 10's, beside its snapshot
    # Step 11 of the second attempt and 11-14 of the third, their snapshot stalls with them.
    assert acc.badput_s["recomputed"] == pytest.approx(5 * 1.0)
    assert acc.productive_s == pytest.approx(16 * 1.0 - 8 * STALL - 0.5)
    assert acc.productive_s + sum(acc.badput_s.values()) == pytest.approx(acc.wall_s)


def test_each_attempt_says_where_it_loaded_from(run):
    _, acc = run
    assert [(a.resumed_from, a.resumed_step) for a in acc.attempts] == SOURCES
    rows = json.loads(json.dumps(acc.as_json()))["attempts"]
    assert [(r["resumed_from"], r["resumed_step"]) for r in rows] == SOURCES
    out = io.StringIO()
    Console(file=out, width=300, color_system=None).print(summary(*run))
    text = out.getvalue()
    cells = [line.split("│")[6].strip() for line in text.splitlines() if "│ 9 " in line]
    assert cells == ["-", "snapshot @ 6", "partner @ 10", "checkpoint @ 10"]
    assert "│ snapshot  " in text  # the cause's row in the wall-time table


def test_the_page_shows_the_cause_and_the_source_in_chromium(run, chromium_rows):
    rows = chromium_rows(render_html(*run))
    attempts = [row for row in rows if len(row) == 12 and row[0] != "#"]
    assert [row[6] for row in attempts] == ["-", "snapshot @ 6", "partner @ 10", "checkpoint @ 10"]
    assert [row[7] for row in attempts] == ["1–6", "7–11", "11–14", "11–16"]
    causes = {row[0]: row[1] for row in rows if len(row) == 3}
    assert causes["snapshot"] == f"{8 * STALL:,.1f}"


def test_more_stall_than_the_step_is_cut_to_it(tmp_path):
    # data 0.5 + checkpoint 0.4 of a 1 s step leave 0.1 s of its 0.3 s snapshot stall.
    attempt = Attempt(
        start=T0, startup_s=1, steps=range(1, 3), data_time_s=0.5, stalls={2: 0.4},
        snapshot_stalls={1: 0.3, 2: 0.3},
    )  # fmt: skip
    write_run(tmp_path, [attempt], done=True)
    acc = account(read_run(tmp_path))
    assert acc.badput_s["snapshot"] == pytest.approx(0.3 + 0.1)
    assert acc.productive_s == pytest.approx(0.2 + 0.0)


@pytest.mark.parametrize(
    ("key", "value", "kind"),
    [
        ("resumed_from", "disk", "not 'snapshot', 'partner' or 'checkpoint'"),
        ("resumed_from", None, "not 'snapshot', 'partner' or 'checkpoint'"),
        ("resumed_step", -1, "not a whole number >= 0"),
        ("resumed_step", 1.5, "not a whole number >= 0"),
        ("snapshot_stall_s", -0.5, "not a finite number >= 0 or null"),
    ],
)
def test_a_source_or_stall_the_trainer_does_not_write_is_refused(tmp_path, key, value, kind):
    write_run(tmp_path, [DONE], done=True)
    metrics = tmp_path / rundir.METRICS
    first, rest = metrics.read_text().split("\n", 1)
    metrics.write_text(json.dumps({**json.loads(first), key: value}) + "\n" + rest)
    with pytest.raises(GoodputError) as refused:
        read_run(tmp_path)
    assert f"{metrics}:1" in str(refused.value) and repr(key) in str(refused.value)
    assert kind in str(refused.value)
