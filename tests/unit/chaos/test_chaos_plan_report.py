"""The parts of a chaos campaign that need no faulted run: the plan drawn from a seed, the faults'
outcomes and the goodput of a hand-made run (attempts, metrics and fired records written as the
launcher, the trainer and the hooks write them) and of real tiny training runs, each the same
figure as ``goodput report``'s, the fired records' reader, and the bitwise comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from goodput import rundir
from goodput.chaos import campaign, compare, outcomes, plan, records
from goodput.cli import main
from goodput.config import to_toml
from goodput.errors import GoodputError
from goodput.faults import IN_SAVE, KINDS, Fault, load_plan
from goodput.io import write_marker
from goodput.launch.history import AttemptRecord, timestamp
from goodput.report.run_files import read_run
from goodput.testing.jobs import outside_any_job
from goodput.testing.tiny import tiny_run_config

# --- the plan -------------------------------------------------------------------------------


def draw(seed: int, num_faults: int = 8, kinds=KINDS, steps: int = 300, interval: int = 10):
    dealt = plan.deal_kinds(num_faults, kinds, seed)
    return plan.draw_faults(
        dealt, num_steps=steps, interval_steps=interval, num_ranks=4, seed=seed,
        straggler_steps=5, snapshot_interval_steps=interval,
    )  # fmt: skip


def test_the_same_seed_draws_the_same_plan_and_another_seed_another():
    assert draw(7) == draw(7)
    assert len({tuple(draw(seed)) for seed in range(20)}) == 20


@pytest.mark.parametrize("seed", range(30))
def test_a_plan_keeps_its_bounds(seed):
    steps, interval = 97, 9
    faults = draw(seed, num_faults=10, steps=steps, interval=interval)
    assert [fault.id for fault in faults] == list(range(10))
    assert [fault.step for fault in faults] == sorted({fault.step for fault in faults})  # distinct
    assert all(1 <= fault.step < steps and 0 <= fault.rank < 4 for fault in faults)
    # A save fault sits on a periodic save before the last step, one fault per save.
    save_steps = [fault.step for fault in faults if fault.kind in IN_SAVE]
    assert all(step % interval == 0 for step in save_steps)
    counts = Counter(fault.kind for fault in faults)
    assert set(counts) == set(KINDS) and max(counts.values()) - min(counts.values()) <= 1
    # Each slow fault owns its window of 5 + 5 steps before the last step, 9 steps (room for a
    # whole watch window) from the next: no other fault in it.
    windows = [range(f.step, f.step + 10) for f in faults if f.kind == "slow"]
    assert all(f.steps == 10 and f.seconds is None for f in faults if f.kind == "slow")
    assert all(window[-1] < steps for window in windows)
    assert all(b.start - a.stop >= 9 for a, b in zip(windows, windows[1:], strict=False))
    for fault in faults:
        assert sum(fault.step in window for window in windows) == (fault.kind == "slow")
    assert all(f.where in ("data", "collective") for f in faults if f.kind == "stall")


def test_kinds_are_dealt_evenly_and_only_from_those_asked():
    faults = draw(3, num_faults=7, kinds=("kill", "nan"))
    assert sorted(Counter(f.kind for f in faults).values()) == [3, 4]


def test_the_written_plan_is_one_the_trainer_reads(tmp_path):
    with pytest.raises(ValueError, match=r"seconds is null"):  # a slow fault not timed yet
        plan.write_plan(tmp_path / "plan.json", draw(5), tmp_path / "fired")
    faults = plan.timed(draw(5), 0.25)
    assert {f.seconds for f in faults if f.kind == "slow"} == {0.25}
    plan.write_plan(tmp_path / "plan.json", faults, tmp_path / "fired")
    loaded = load_plan({"GOODPUT_FAULTS": str(tmp_path / "plan.json")})
    assert loaded is not None and loaded.faults == faults
    assert loaded.fired_dir == tmp_path / "fired"


def test_the_interval_is_set_only_when_the_config_saves_too_rarely():
    assert plan.interval_needed(300, 2, 100) is None  # saves at 100 and 200: enough
    assert plan.interval_needed(300, 3, 100) == 30  # three save faults need three saves
    assert plan.interval_needed(300, 0, 0) == 30  # never saving: no final checkpoint
    assert plan.interval_needed(40, 5, 0) == 4
    assert plan.interval_needed(8, 7, 0) == 1


def test_a_plan_that_cannot_fit_is_a_usage_error_naming_faults():
    with pytest.raises(GoodputError) as refused:
        draw(0, num_faults=12, kinds=("kill",), steps=10)
    assert refused.value.where == "--faults" and refused.value.code == 2
    with pytest.raises(GoodputError, match="checkpoint faults need"):
        draw(0, num_faults=3, kinds=("save-fail",), steps=30, interval=10)  # saves 10 and 20


# --- the faults' outcomes, on the report's account -----------------------------------------

T0 = 1_700_000_000.0


def at(offset: float) -> str:
    return timestamp(datetime.fromtimestamp(T0 + offset, UTC))


def attempt(number, started, ended, first, last, *, success, wait_s=None):
    return AttemptRecord(
        attempt=number,
        of=None,
        job=None,
        class_="success" if success else "error",
        exit_code=0 if success else 137,
        timed_out=False,
        first_failure_label=None if success else "rank1",
        started=at(started),
        first_step_at=at(started + 1),
        ended=at(ended),
        steps_seen=last - first + 1,
        first_step=first,
        last_step=last,
        steps_gained=last - first + 1,
        hosts=("localhost",),
        evidence=(),
        replaced={},
        spares_left=(),
        decision="stop" if success else "retry",
        reason="done" if success else None,
        wait_s=wait_s,
    )


def step_line(step: int, end: float, **timings: float) -> str:
    record = {"step": step, "loss": 4.0 - step / 10, "step_time_s": 1.0, "time": T0 + end}
    return json.dumps({**record, "grad_norm": 1.0, "mfu": None, **timings}) + "\n"


@pytest.fixture
def killed_once(tmp_path) -> Path:
    """Attempt 1: 2 s start-up, steps 1-5 of 1 s, a kill at 7.25 s (checkpoint at step 4), ended
    at 7.5 s; wait 0.5 s, 0.25 s of classifying. Attempt 2 from 8.25 s: resumes from step 4 with
    a 0.5 s load, starts step 5 at 9.75 s, steps 5-8, a failed save at 11.8 s, ends at 14.25 s,
    done. Written as the launcher, the trainer and the fault hooks write them."""
    history = [
        attempt(1, 0.0, 7.5, 1, 5, success=False, wait_s=0.5),
        attempt(2, 8.25, 14.25, 5, 8, success=True),
    ]
    (tmp_path / rundir.ATTEMPTS).write_text(
        "".join(json.dumps(r.to_json()) + "\n" for r in history)
    )
    lines = [step_line(step, end) for step, end in ((2, 4), (3, 5), (4, 6), (5, 7))]
    lines.insert(0, step_line(1, 3, startup_s=2.0))
    lines.append(step_line(5, 10.75, startup_s=2.5, checkpoint_load_s=0.5))
    lines += [step_line(step, end) for step, end in ((6, 11.75), (7, 12.75), (8, 13.75))]
    (tmp_path / rundir.METRICS).write_text("".join(lines))
    write_marker(tmp_path, rundir.DONE)
    fired = tmp_path / "fired"
    fired.mkdir()
    for fault_id, kind, step, when in ((0, "kill", 5, 7.25), (1, "save-fail", 6, 11.8)):
        record = {"id": fault_id, "kind": kind, "step": step, "rank": 1, "time": T0 + when}
        (fired / f"{fault_id}.json").write_text(json.dumps(record))
    (fired / ".2.json.abc.tmp").write_text("{")  # an atomic write's temp file: not a record
    return tmp_path


def report_json(run_dir: Path, capsys) -> dict:
    """``goodput report RUN --json``, as a person runs it."""
    capsys.readouterr()
    assert main(["report", str(run_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_campaign_counts_goodput_as_goodput_report_does(killed_once, capsys):
    accounted = campaign.account_run(killed_once)
    assert accounted.accounting.as_json() == report_json(killed_once, capsys)
    acc = accounted.accounting
    assert acc.wall_s == pytest.approx(14.25, abs=2e-3)
    assert acc.productive_s == pytest.approx(8.0, abs=2e-3)  # steps 1-4, then 5-8 again
    expected = {"startup": 3.0, "checkpoint_load": 0.5, "recomputed": 1.0, "backoff": 0.75,
                "shutdown": 1.0}  # fmt: skip
    for cause, seconds in acc.badput_s.items():
        assert seconds == pytest.approx(expected.get(cause, 0.0), abs=2e-3), cause


def test_each_fault_gets_its_detection_loss_and_recovery(killed_once):
    timeline = campaign.account_run(killed_once).accounting.timeline
    fired = records.read_fired(killed_once / "fired")
    planned = [
        Fault(0, "kill", 5, 1),
        Fault(1, "save-fail", 6, 1),
        Fault(2, "hang", 7, 0),  # never fired
    ]
    kill, save_fail, hang = outcomes.fault_outcomes(planned, fired, timeline, ranks_per_host=2)
    assert kill.attempt == 1 and kill.steps_lost == 1  # ran to 5, resumed from 4
    figures = {
        "at_s": 7.25,
        "detection_s": 0.5,  # the kill at 7.25 -> its attempt's end at 7.5, + 0.25 s classifying
        "backoff_s": 0.5,
        "startup_s": 1.0,  # 8.25 -> step 5's start at 9.75, less the load
        "load_s": 0.5,
        "first_step_s": 1.0,
        "recovery_s": 3.5,  # the fault at 7.25 -> step 5 back at 10.75
    }
    for key, value in figures.items():
        assert getattr(kill, key) == pytest.approx(value, abs=2e-3), key
    assert save_fail.attempt == 2 and save_fail.fired.step == 6
    assert save_fail.recovery_s is None and save_fail.steps_lost is None  # the run went on
    assert hang.fired is None and hang.attempt is None


def test_a_fault_outside_every_attempt_is_placed_in_none(killed_once):
    timeline = campaign.account_run(killed_once).accounting.timeline
    late = records.FiredRecord(0, "kill", 5, 1, T0 + 99.0)  # after the run ended
    (outcome,) = outcomes.fault_outcomes(
        [Fault(0, "kill", 5, 1)], [late], timeline, ranks_per_host=2
    )
    assert outcome.at_s == pytest.approx(99.0) and outcome.attempt is None
    assert outcome.detection_s is None and outcome.recovery_s is None


# --- the readers ----------------------------------------------------------------------------


def test_a_fired_record_must_be_what_the_hooks_write(tmp_path):
    (tmp_path / "3.json").write_text(
        json.dumps({"id": 4, "kind": "kill", "step": 1, "rank": 0, "time": 1.0})
    )
    with pytest.raises(GoodputError, match="another fault's id"):
        records.read_fired(tmp_path)
    (tmp_path / "3.json").write_text(json.dumps({"id": 3, "kind": "kill", "step": 1}))
    with pytest.raises(GoodputError, match="exactly"):
        records.read_fired(tmp_path)
    assert records.read_fired(tmp_path / "absent") == []


# --- the comparison -------------------------------------------------------------------------


def test_tensors_are_compared_bit_for_bit():
    nan = torch.tensor([1.0, float("nan")])
    assert compare.tensor_difference(nan, nan.clone()) is None
    assert "element (0,)" in compare.tensor_difference(torch.zeros(2), -torch.zeros(2))
    found = compare.tensor_difference(
        torch.ones(2, 3), torch.ones(2, 3).index_fill(1, torch.tensor([2]), 2)
    )
    assert found == "element (0, 2): 2.0 against the reference's 1.0"
    assert "float64" in compare.tensor_difference(torch.ones(2), torch.ones(2, dtype=torch.float64))


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory) -> dict[str, Path]:
    """The tiny config trained three times as one process: twice alike, once with another
    model seed."""
    base = tmp_path_factory.mktemp("runs")
    cfg = tiny_run_config(base)
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, interval_steps=4))
    config = base / "run.toml"
    config.write_text(to_toml(cfg))
    runs = {}
    for name, extra in (("a", []), ("b", []), ("seed", ["train.seed=1"])):
        run_dir = base / name
        argv = [sys.executable, "-m", "goodput", "train", str(config), f"train.run_dir={run_dir}"]
        result = subprocess.run(
            [*argv, *extra], env=outside_any_job(), capture_output=True, text=True, timeout=240
        )
        assert result.returncode == 0, result.stderr
        runs[name] = run_dir
    return runs


def compare_runs(reference: Path, other: Path) -> compare.Comparison:
    parts = compare.compare_checkpoints(
        compare.final_checkpoint(reference, 8), compare.final_checkpoint(other, 8)
    )
    losses = compare.compare_losses(read_run(reference).steps, read_run(other).steps, 8)
    return compare.Comparison(losses=losses, **parts)


def test_two_runs_of_one_config_are_bitwise_equal(three_runs):
    found = compare_runs(three_runs["a"], three_runs["b"])
    assert found.equal and found.first_difference is None


def test_real_runs_have_the_goodput_goodput_report_gives(three_runs, capsys):
    for run_dir in three_runs.values():
        acc = campaign.account_run(run_dir).accounting
        assert acc.as_json() == report_json(run_dir, capsys)
        assert 0 < acc.goodput < 1 and (acc.steps_kept, acc.steps_recomputed) == (8, 0)


def test_another_seed_differs_from_its_first_step_and_in_every_part(three_runs):
    found = compare_runs(three_runs["a"], three_runs["seed"])
    assert not found.equal
    assert found.first_difference.startswith("losses: step 1: ")
    assert found.weights.startswith("model.embedding.weight: element (0, 0): ")
    assert found.optimizer is not None
    assert found.rng is not None  # the seed seeds the generators too
    # Same data position and optimizer settings; only the diagnostics, which follow the losses.
    assert found.train_state == "loss_spikes.losses differs"


def test_a_repeated_step_must_repeat_its_loss(three_runs):
    reference = read_run(three_runs["a"]).steps
    resumed = [*reference[:5], *reference[3:]]  # steps 4 and 5 run again, as after a resume
    assert compare.compare_losses(reference, resumed, 8) is None
    values = resumed[4].values
    changed = replace(resumed[4], values={**values, "loss": values["loss"] + 1e-7})  # step 5
    found = compare.compare_losses(reference, [*resumed[:4], changed, *resumed[5:]], 8)
    assert found.startswith("step 5: ")
    null = replace(resumed[4], values={})  # the trainer wrote null: the loss was not finite
    found = compare.compare_losses(reference, [*resumed[:4], null, *resumed[5:]], 8)
    assert found.startswith("step 5: None against the reference's ")
    assert (
        compare.compare_losses(reference, reference[:7], 8)
        == "the faulted run has no loss of step 8"
    )


def test_a_run_without_its_final_checkpoint_is_refused(three_runs, tmp_path):
    with pytest.raises(GoodputError, match="did not save its last step"):
        compare.final_checkpoint(three_runs["a"], 9)
