"""The goodput arithmetic on synthetic run directories whose every second is known: two attempts
of one job (a crash after step 6, a resume from step 4's checkpoint), a run not yet done, a job
chain's queue gap, a hang, and a run launched by hand (no attempts log)."""

import json

import pytest

from goodput import rundir
from goodput.cli import main
from goodput.errors import GoodputError
from goodput.launch.history import Evidence, Recovery
from goodput.report.accounting import CAUSES, account
from goodput.report.html import render_html
from goodput.report.run_files import read_run
from goodput.testing.run_dirs import TOKENS_PER_STEP, Attempt, write_run

T0 = 1_800_000_000.0

CRASHED = Attempt(
    start=T0, startup_s=10, steps=range(1, 7), data_time_s=0.1, stalls={5: 0.5}, tail_s=4,
    class_="error", exit_code=1, job="100", wait_s=5,
    evidence=(Evidence("nid0001", "NCCL error: unhandled system error\nmore", "log"),),
    replaced={"nid0001": "nid0009"},
)  # fmt: skip
RESUMED = Attempt(
    start=T0 + 25, startup_s=8, checkpoint_load_s=2, steps=range(5, 11), data_time_s=0.1,
    stalls={9: 0.5}, evals={10: 1.5}, tail_s=0.5, job="100", host="nid0009",
)  # fmt: skip


def test_an_in_process_recovery_is_a_cause_of_its_own_split_into_its_parts(tmp_path):
    """The attempt that recovered the one before in process (goodput launch --in-process):
    its lead-in is ``in_process_recovery``, not start-up or checkpoint load, and its summary
    splits it into the launcher's abort and rendezvous, the restore, the rebuild and the
    first step; the death's detection is the attempt before's tail."""
    died = Attempt(
        start=T0, startup_s=10, steps=range(1, 7), tail_s=0.25, class_="error",
        exit_code=137, wait_s=0.0,
    )  # fmt: skip
    recovered = Attempt(
        start=died.end(), startup_s=1.5, checkpoint_load_s=0.5, steps=range(6, 11),
        resumed=("snapshot", 5),
        recovery=Recovery(rank=1, spare=0, generation=1, abort_s=0.3, rendezvous_s=0.05),
    )  # fmt: skip
    write_run(tmp_path, [died, recovered], done=True)
    acc = account(read_run(tmp_path))
    assert acc.badput_s["in_process_recovery"] == pytest.approx(1.5)
    assert acc.badput_s["startup"] == pytest.approx(10)  # the first start alone
    assert acc.badput_s["checkpoint_load"] == 0 and acc.badput_s["backoff"] == 0
    assert acc.badput_s["shutdown"] == pytest.approx(0.25)
    assert acc.productive_s + sum(acc.badput_s.values()) == pytest.approx(acc.wall_s)
    first, second = acc.attempts
    assert first.in_process_recovery is None
    assert second.in_process_recovery == pytest.approx(
        {
            "detection_s": 0.25,
            "abort_s": 0.3,
            "rendezvous_s": 0.05,
            "restore_s": 0.5,
            "rebuild_s": 0.65,
            "first_step_s": 1.0,
        }  # fmt: skip
    )


def test_a_fallen_back_recovery_is_charged_as_a_restart(tmp_path):
    """A recovery that fell back (its record's ``fallback``) started nothing in process."""
    died = Attempt(start=T0, startup_s=10, steps=range(1, 4), class_="error", exit_code=137,
                   wait_s=0.0)  # fmt: skip
    fell_back = Attempt(
        start=died.end(), startup_s=0.1, steps=range(0), class_="error", exit_code=137,
        wait_s=1.0, recovery=Recovery(rank=1, fallback="no warm spare is alive"),
    )  # fmt: skip
    restarted = Attempt(start=fell_back.end() + 1.0, startup_s=4, steps=range(3, 6))
    write_run(tmp_path, [died, fell_back, restarted], done=True)
    acc = account(read_run(tmp_path))
    assert acc.badput_s["in_process_recovery"] == 0
    assert acc.badput_s["failed_start"] == pytest.approx(0.1)
    assert all(summary.in_process_recovery is None for summary in acc.attempts)


def test_every_second_of_a_crash_and_resume_is_accounted(tmp_path):
    write_run(tmp_path, [CRASHED, RESUMED], checkpoints=[4, 8, 10], done=True)
    acc = account(read_run(tmp_path))
    assert acc.wall_s == pytest.approx(41.0)
    # steps 1-4 of the first attempt and 5-10 of the second, less data and the save's stall
    assert acc.productive_s == pytest.approx(10 * 0.9 - 0.5)
    assert acc.badput_s == pytest.approx(
        {
            "startup": 10 + (8 - 2),
            "checkpoint_load": 2,
            "data": 10 * 0.1,
            "checkpoint_save": 0.5,  # step 9's; step 5's was in a step run again
            "snapshot": 0,
            "eval": 1.5,
            "recomputed": 2.0,  # steps 5 and 6 of the crashed attempt
            "not_checkpointed": 0,
            "hang": 0,
            "shutdown": 4 + 0.5,
            "failed_start": 0,
            "in_process_recovery": 0,
            "backoff": 5,
            "queue": 0,
            "other": 0,
        },
        abs=1e-6,
    )
    assert acc.productive_s + sum(acc.badput_s.values()) == pytest.approx(acc.wall_s)
    assert acc.goodput == pytest.approx(8.5 / 41)
    assert (acc.steps_kept, acc.steps_recomputed, acc.last_step) == (10, 2, 10)
    assert acc.tokens_kept == 10 * TOKENS_PER_STEP
    assert acc.tokens_ideal == pytest.approx(41 * TOKENS_PER_STEP)
    first, second = acc.attempts
    assert (first.class_, first.first_step, first.last_step, first.hosts_evicted) == (
        "error",
        1,
        6,
        ["nid0001"],
    )
    assert first.evidence == "NCCL error: unhandled system error"
    assert first.recovery_s == pytest.approx(5 + 8)  # to the next first step: backoff, start-up
    assert (second.class_, second.first_step, second.recovery_s) == ("success", 5, None)
    data = acc.as_json()
    assert set(data["badput_s"]) == set(CAUSES) and data["goodput"] == acc.goodput
    json.dumps(data)  # the --json output is plain JSON


def test_the_timeline_is_the_one_charged(tmp_path):
    """What chaos builds its per-fault figures on: each attempt's span with its steps, and its
    lead-in split as the account charged it."""
    write_run(tmp_path, [CRASHED, RESUMED], checkpoints=[4, 8, 10], done=True)
    acc = account(read_run(tmp_path))
    spans = [(span.start, span.end) for span in acc.timeline]
    assert spans == [(attempt.started, attempt.ended) for attempt in acc.attempts]
    assert [[step.step for step in span.steps] for span in acc.timeline] == [
        [1, 2, 3, 4, 5, 6],
        [5, 6, 7, 8, 9, 10],
    ]
    lead_ins = [value for span in acc.timeline for value in span.lead_in()]
    assert lead_ins == pytest.approx([10, 0, 6, 2])  # (start-up, checkpoint load) of each


def test_steps_past_the_newest_checkpoint_are_not_preserved_yet(tmp_path):
    write_run(tmp_path, [CRASHED, RESUMED], checkpoints=[4, 8], done=False)
    acc = account(read_run(tmp_path))
    assert acc.badput_s["not_checkpointed"] == pytest.approx((0.9 - 0.5) + 0.9)  # steps 9, 10
    assert acc.productive_s == pytest.approx(8.5 - 1.3)
    assert acc.steps_kept == 8 and not acc.done


def test_a_chains_queue_gap_and_a_hang(tmp_path):
    hung = Attempt(start=T0, startup_s=5, steps=range(1, 5), tail_s=30, class_="hang",
                   exit_code=124, timed_out=True, job="100", wait_s=None)  # fmt: skip
    next_job = Attempt(start=T0 + 39 + 600, startup_s=5, steps=range(5, 9), job="101")
    write_run(tmp_path, [hung, next_job], checkpoints=[4, 8], done=True)
    acc = account(read_run(tmp_path))
    assert acc.badput_s["hang"] == pytest.approx(30)
    assert acc.badput_s["queue"] == pytest.approx(600)
    assert acc.badput_s["backoff"] == 0 and acc.productive_s == pytest.approx(8)
    assert acc.wall_s == pytest.approx(39 + 600 + 9)


def test_a_run_launched_by_hand_is_cut_at_each_start(tmp_path):
    """No attempts log: each process's start is its first step's less its startup_s."""
    write_run(tmp_path, [CRASHED, RESUMED], checkpoints=[4, 8, 10], done=True)
    (tmp_path / "attempts.jsonl").unlink()
    acc = account(read_run(tmp_path))
    assert acc.wall_s == pytest.approx(41 - 0.5)  # no record of the last tail
    assert acc.badput_s["startup"] == pytest.approx(16)
    assert acc.badput_s["queue"] == pytest.approx(4 + 5)  # crash to restart: unaccounted
    assert [a.class_ for a in acc.attempts] == ["unrecorded", "unrecorded"]


def test_a_live_attempt_runs_to_now(tmp_path):
    write_run(tmp_path, [CRASHED], checkpoints=[4], done=False)
    with open(tmp_path / "metrics.jsonl", "a") as metrics:
        for step, ended in [(5, T0 + 40), (6, T0 + 41)]:
            record = {"step": step, "step_time_s": 1.0, "tokens_per_s": 4096.0, "time": ended}
            if step == 5:
                record["startup_s"] = 5.0
            metrics.write(json.dumps(record) + "\n")
        metrics.write('{"step": 7, "step_ti')  # being written: left out
    acc = account(read_run(tmp_path), now=T0 + 45)
    assert acc.attempts[-1].class_ == "running" and acc.attempts[-1].started == T0 + 34
    assert acc.end == T0 + 45 and acc.last_step == 6


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"step": -1, "time": 1, "step_time_s": 1}', "'step' is -1"),
        ('{"step": 1, "time": 1, "step_time_s": "1"}', "'step_time_s'"),
        ('{"step": 1, "time": 1, "step_time_s": NaN}', "not a JSON line"),
        ("[1, 2]", "not a JSON object"),
        ("x" * (rundir.MAX_LINE_BYTES + 1), "longer than"),
    ],
)
def test_a_damaged_metrics_line_is_one_error_naming_it(tmp_path, line, message):
    (tmp_path / "metrics.jsonl").write_text(f'{{"step": 1, "time": 1, "step_time_s": 1}}\n{line}\n')
    with pytest.raises(GoodputError, match=message) as error:
        read_run(tmp_path)
    assert error.value.render().startswith(f"{tmp_path / 'metrics.jsonl'}:2:")


def test_a_folder_that_is_no_run_is_refused(tmp_path):
    with pytest.raises(GoodputError, match="no run to report"):
        read_run(tmp_path)


def test_run_json_naming_a_damaged_blend_is_one_error(tmp_path):
    write_run(tmp_path / "run", [RESUMED], checkpoints=[10], done=True)
    blend = tmp_path / "blend"
    blend.mkdir()
    record = {"data": {"blend": str(blend)}}
    (tmp_path / "run" / "run.json").write_text(json.dumps(record))
    assert read_run(tmp_path / "run").mixture is None  # no blend.json there: no mixture plot
    (blend / "blend.json").write_text('{"format": 1}')
    with pytest.raises(GoodputError) as error:
        read_run(tmp_path / "run")
    assert error.value.render().startswith(str(blend / "blend.json"))
    (tmp_path / "run" / "lr_find.json").write_text('{"curve": 3}')
    (blend / "blend.json").unlink()
    with pytest.raises(GoodputError, match="lr-find"):
        read_run(tmp_path / "run")


def _invariants_hold(acc):
    """Every figure finite, none negative, goodput in [0, 1], the causes adding up."""
    json.dumps(acc.as_json(), allow_nan=False)
    assert 0 <= acc.goodput <= 1 and 0 <= acc.token_goodput <= 1
    assert acc.productive_s >= 0 and min(acc.badput_s.values()) >= 0
    assert acc.productive_s + sum(acc.badput_s.values()) == pytest.approx(acc.wall_s, abs=1e-6)


def _keep_attempt_lines(run_dir, *numbers):
    lines = (run_dir / "attempts.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "attempts.jsonl").write_text("".join(lines[n - 1] for n in numbers))


def test_a_run_trained_by_hand_then_launched_is_one_timeline(tmp_path):
    """`goodput train` by hand for steps 1-5, then `goodput launch --run-dir` on the same folder:
    the hand process has no attempt record, and its steps still lie inside the wall time (the
    report said 550 % when they did not)."""
    by_hand = Attempt(start=T0, startup_s=5, steps=range(1, 6))
    launched = Attempt(start=T0 + 30, startup_s=4, checkpoint_load_s=1, steps=range(6, 11),
                       tail_s=2)  # fmt: skip
    write_run(tmp_path, [by_hand, launched], checkpoints=[5, 10], done=True)
    _keep_attempt_lines(tmp_path, 2)  # the hand process wrote no record
    acc = account(read_run(tmp_path))
    assert (acc.start, acc.end, acc.wall_s) == (T0, T0 + 41, 41)
    assert acc.productive_s == pytest.approx(10) and acc.goodput == pytest.approx(10 / 41)
    assert {cause: s for cause, s in acc.badput_s.items() if s} == pytest.approx(
        {"startup": 5 + 3, "checkpoint_load": 1, "queue": 20, "shutdown": 2}
    )
    assert [(a.class_, a.first_step, a.last_step) for a in acc.attempts] == [
        ("unrecorded", 1, 5),
        ("success", 6, 10),
    ]
    assert acc.ignored == [] and acc.tokens_ideal == pytest.approx(41 * TOKENS_PER_STEP)
    _invariants_hold(acc)


def test_a_hand_process_that_ended_just_before_a_launch_keeps_its_steps(tmp_path):
    """Its last steps end within the clocks' slack of the launched attempt's start: they are
    still the hand process's, not the attempt's (which would cut them to nothing)."""
    by_hand = Attempt(start=T0, startup_s=5, steps=range(1, 6), tail_s=0.2)
    launched = Attempt(start=by_hand.end() + 0.1, startup_s=4, steps=range(6, 11), tail_s=2)
    write_run(tmp_path, [by_hand, launched], checkpoints=[5, 10], done=True)
    _keep_attempt_lines(tmp_path, 2)
    acc = account(read_run(tmp_path))
    assert [(a.class_, a.first_step, a.last_step) for a in acc.attempts] == [
        ("unrecorded", 1, 5),
        ("success", 6, 10),
    ]
    assert acc.productive_s == pytest.approx(10) and acc.ignored == []
    _invariants_hold(acc)


def test_a_hand_process_between_launched_attempts_and_after_them(tmp_path):
    attempts = [
        Attempt(start=T0, startup_s=2, steps=range(1, 4), tail_s=1, job="1"),
        Attempt(start=T0 + 10, startup_s=2, steps=range(4, 7)),  # by hand
        Attempt(start=T0 + 20, startup_s=2, steps=range(7, 9), tail_s=1, job="1"),
        Attempt(start=T0 + 30, startup_s=2, steps=range(9, 11)),  # by hand, going on
    ]
    write_run(tmp_path, attempts, checkpoints=[10], done=False)
    _keep_attempt_lines(tmp_path, 1, 3)
    acc = account(read_run(tmp_path), now=T0 + 40)
    assert [a.class_ for a in acc.attempts] == ["success", "unrecorded", "success", "running"]
    assert acc.wall_s == 40 and acc.productive_s == pytest.approx(10)
    # The hand processes stand between the two records of job 1: queue, not backoff.
    assert acc.badput_s["queue"] == pytest.approx(4 + 5 + 5)
    assert acc.badput_s["backoff"] == 0 and acc.badput_s["shutdown"] == pytest.approx(2 + 6)
    _invariants_hold(acc)


def test_records_that_break_the_timeline_are_named_and_left_out(tmp_path, capsys, monkeypatch):
    lines = [
        {"step": 1, "time": T0 + 10, "step_time_s": 1, "startup_s": 5},
        {"step": 2, "time": T0 + 11, "step_time_s": 1},
        {"step": 3, "time": T0 + 12, "step_time_s": 5},  # overlaps step 2 by 4 s
        {"step": 3, "time": T0 + 12.5, "step_time_s": 1},
        {"step": 4, "time": T0 + 2, "step_time_s": 1},  # the clock went back
        {"step": 4, "time": T0 + 13.5, "step_time_s": 1e300},  # absurd
        {"step": 4, "time": T0 + 13.3, "step_time_s": 0.1, "data_time_s": 4000.0},
        {"step": 5, "time": T0 + 14.4, "step_time_s": 1, "data_time_s": 0.25},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "done").write_text("")
    acc = account(read_run(tmp_path))
    assert [(i.file, i.line) for i in acc.ignored] == [(str(metrics), n) for n in (3, 5, 6)]
    assert "overlaps step 2 (line 2) by 4.000 s" in acc.ignored[0].why
    assert "clock went back" in acc.ignored[1].why and "step_time_s 1e+300" in acc.ignored[2].why
    # Process start T0 + 4; steps of lines 1, 2, 4, 7 (its data wait cut to its 0.1 s) and 8.
    assert (acc.start, acc.wall_s) == (T0 + 4, pytest.approx(10.4))
    assert acc.productive_s == pytest.approx(1 + 1 + 1 + 0 + 0.75)
    assert acc.badput_s["data"] == pytest.approx(0.1 + 0.25)
    assert acc.badput_s["startup"] == 5 and acc.badput_s["other"] == pytest.approx(0.5 + 0.7 + 0.1)
    _invariants_hold(acc)
    assert main(["report", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ignored_total"] == 3
    assert report["ignored"][0] == {"file": str(metrics), "line": 3, "why": acc.ignored[0].why}
    monkeypatch.setenv("COLUMNS", "300")  # rich: no line folded
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 record(s) left out" in out and f"  {metrics}:5: step 4 ends at " in out
    assert f"{metrics}:6: step 4: step_time_s" in render_html(read_run(tmp_path), acc)


def test_attempt_records_that_overlap_are_named_and_left_out(tmp_path):
    first = Attempt(start=T0, startup_s=2, steps=range(1, 5), tail_s=1, job="1", wait_s=1)
    again = Attempt(start=T0 + 3, startup_s=1, steps=range(1, 3), job="1")  # starts inside
    write_run(tmp_path, [first, again], done=True)
    acc = account(read_run(tmp_path))
    attempts = str(tmp_path / "attempts.jsonl")
    assert [(i.file, i.line) for i in acc.ignored][0] == (attempts, 2)
    assert "before the attempt of line 1 ended" in acc.ignored[0].why
    assert len(acc.attempts) == 1 and acc.wall_s == 7
    _invariants_hold(acc)


def test_a_step_reaching_before_its_attempt_is_left_out(tmp_path):
    write_run(tmp_path, [Attempt(start=T0, startup_s=2, steps=range(1, 4), tail_s=1)], done=True)
    with open(tmp_path / "metrics.jsonl", "a") as metrics:
        metrics.write(json.dumps({"step": 4, "time": T0 + 5.5, "step_time_s": 4000.0}) + "\n")
    acc = account(read_run(tmp_path))
    assert [i.line for i in acc.ignored] == [4] and "step 4 overlaps step 3" in acc.ignored[0].why
    assert acc.goodput == pytest.approx(3 / 6)
    _invariants_hold(acc)
