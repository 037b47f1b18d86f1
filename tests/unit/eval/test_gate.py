"""The eval gate: its rule on made-up scores, its state in a checkpoint, and the seed's failure
(pure-bf16 weights, frozen norm gains) and a task stuck at chance driven through the real loop
into the alarm, the metrics flag and the stop with exit code 3; a learning run never trips."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from goodput.checkpoint.state import CheckpointContents
from goodput.config import to_toml
from goodput.errors import ExitCode, GoodputError
from goodput.eval.choice_tasks import ChoiceItem
from goodput.eval.config import EvalConfig
from goodput.eval.gate import EvalGate, at_chance
from goodput.eval.harness import summarize
from goodput.testing.tiny import tokenized_run_config, write_spelling_task
from goodput.train.config.run import DiagnosticsConfig
from goodput.train.loop import train

ITEMS = [ChoiceItem("q", (" a", " b", " c", " d"), i % 4) for i in range(40)]


def scores(num_right: int):
    """Scores of ITEMS with the first ``num_right`` answered right (the rest pick a wrong one)."""
    loglikelihoods = []
    for index, item in enumerate(ITEMS):
        right = index < num_right
        chosen = item.answer if right else (item.answer + 1) % 4
        loglikelihoods.append([0.0 if c == chosen else -1.0 for c in range(4)])
    return summarize(ITEMS, loglikelihoods)


def test_at_chance_is_within_two_standard_errors():
    assert at_chance(scores(10))  # 0.25 = chance
    assert at_chance(scores(15))  # 0.375 <= 0.25 + 2 x 0.078
    assert not at_chance(scores(20))  # 0.5


def falling(gate, start, count=4):
    for i in range(count - 1):
        assert gate.observe(i, start - i) is None


def test_alarm_after_k_evals_at_chance_while_the_loss_falls():
    gate = EvalGate(alarm_evals=3, stop_on_alarm=False)
    for eval_number in range(2):
        falling(gate, 10 - 4 * eval_number)
        assert gate.observe(0, 1.0, tasks={"arc": scores(10)}) is None
    falling(gate, 2)
    line = gate.observe(12, -2.0, tasks={"arc": scores(10)})
    assert line is not None and line.startswith("warning: eval gate: step 12: ")
    assert "every task at chance for 3 evals in a row (arc 0.250 (chance 0.250))" in line


def test_a_task_above_chance_or_a_flat_loss_resets_the_count():
    gate = EvalGate(alarm_evals=2, stop_on_alarm=False)
    falling(gate, 10)
    gate.observe(0, 6.0, tasks={"arc": scores(10)})
    falling(gate, 5)
    # one task above chance: learning
    assert gate.observe(0, 1.0, tasks={"arc": scores(10), "piqa": scores(30)}) is None
    assert gate.at_chance_in_a_row == 0
    falling(gate, 10)
    gate.observe(0, 6.0, tasks={"arc": scores(10)})
    for _ in range(4):  # flat: not the pathology the gate watches
        gate.observe(0, 3.0)
    assert gate.observe(0, 3.0, tasks={"arc": scores(10)}) is None
    assert gate.at_chance_in_a_row == 0


def test_the_freeze_check_raises_the_alarm_at_once():
    gate = EvalGate(alarm_evals=5, stop_on_alarm=True)
    line = gate.observe(100, 3.0, frozen=["layers.0.attention_norm.weight"])
    assert line is not None and "bf16 freeze check found 1 tensor(s) not training" in line
    error = gate.stop_error(100)
    assert error.code == ExitCode.NOT_LEARNING == 3


@pytest.mark.parametrize(
    "state",
    [None, [], {"at_chance_in_a_row": -1}, {"at_chance_in_a_row": 1.5},
     {"at_chance_in_a_row": True}, {"at_chance_in_a_row": 2**40},
     {"at_chance_in_a_row": 1, "x": 0}],
)  # fmt: skip
def test_a_damaged_gate_state_is_refused_naming_the_file(state, tmp_path):
    path = tmp_path / "train_state.json"
    contents = CheckpointContents(parts=[], optimizers=[], states={"gate": EvalGate(3, False)})
    with pytest.raises(GoodputError, match="damaged: eval_gate") as error:
        contents.load_train_state({"eval_gate": state}, path)
    assert error.value.render().startswith(str(path))


def test_the_count_survives_a_checkpoint():
    gate = EvalGate(alarm_evals=3, stop_on_alarm=False, at_chance_in_a_row=2)
    again = EvalGate(3, False)
    again.load_state_dict(gate.state_dict())
    assert again.at_chance_in_a_row == 2


def tied_task(path: Path) -> Path:
    """Every choice the same text: log-likelihoods tie, the first choice wins, the answer is the
    second: accuracy 0, at chance whatever the model learns."""
    lines = [
        json.dumps({"ctx": "alpha beta", "endings": ["gamma", "gamma"], "label": 1})
        for _ in range(8)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def tied_run(tmp_path):
    cfg, _ = tokenized_run_config(tmp_path)
    task = tied_task(tmp_path / "tied.jsonl")
    return replace(
        cfg,
        eval=EvalConfig(interval_steps=2, tasks=(f"hellaswag:{task}",), alarm_evals=2),
    )


def records(cfg):
    text = (Path(cfg.train.run_dir) / "metrics.jsonl").read_text()
    return {r["step"]: r for r in map(json.loads, text.splitlines())}


def test_a_task_stuck_at_chance_while_the_loss_falls_trips_the_gate(tied_run, capsys):
    losses = train(tied_run)
    assert losses[-1] < losses[0]
    alarms = [line for line in capsys.readouterr().out.splitlines() if "eval gate" in line]
    assert [line.split(":")[2] for line in alarms] == [" step 4", " step 6", " step 8"]
    flagged = {step for step, r in records(tied_run).items() if r.get("eval_alarm") == 1}
    assert flagged == {4, 6, 8}


def test_stop_on_alarm_stops_the_run_with_exit_code_3(tied_run, tmp_path):
    cfg = replace(tied_run, eval=replace(tied_run.eval, stop_on_alarm=True))
    with pytest.raises(GoodputError, match="stopped at step 4 by the eval gate") as error:
        train(cfg)
    assert error.value.code == ExitCode.NOT_LEARNING
    assert max(records(cfg)) == 4 and not (Path(cfg.train.run_dir) / "done").exists()
    # Through the command line, as a launcher sees it.
    config = tmp_path / "gate.toml"
    config.write_text(
        to_toml(replace(cfg, train=replace(cfg.train, run_dir=str(tmp_path / "cli"))))
    )
    result = subprocess.run(
        [sys.executable, "-m", "goodput", "train", str(config)], capture_output=True, text=True
    )
    assert result.returncode == 3, result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("goodput: error: train: stopped at step 4 by the eval gate")
    )


def test_the_seeds_failure_trips_the_gate_and_a_healthy_run_does_not(tied_run, capsys):
    """Pure-bf16 weights at lr 1e-3: the norm gains' updates round away (the seed's 17,000
    steps at chance); under fp32 master weights the same run is quiet."""
    base = replace(
        tied_run,
        schedule=replace(tied_run.schedule, lr=1e-3),
        diagnostics=DiagnosticsConfig(freeze_check_interval=4),
        eval=replace(tied_run.eval, alarm_evals=100, stop_on_alarm=True),
    )
    frozen = replace(base, parallel=replace(base.parallel, precision="pure-bf16"))
    with pytest.raises(GoodputError, match="stopped at step 4 by the eval gate"):
        train(frozen)
    out = capsys.readouterr().out
    assert "warning: eval gate: step 4: " in out and "bf16 freeze check found" in out
    assert records(frozen)[4]["eval_alarm"] == 1
    learned = write_spelling_task(Path(base.train.run_dir).parent / "spelling.jsonl")
    healthy = replace(
        base,
        train=replace(base.train, run_dir=str(Path(base.train.run_dir).parent / "healthy")),
        parallel=replace(base.parallel, precision="fp32-master"),
        eval=EvalConfig(interval_steps=2, tasks=(f"hellaswag:{learned}",), alarm_evals=2),
    )
    train(healthy)
    assert "eval gate" not in capsys.readouterr().out
    assert all("eval_alarm" not in r for r in records(healthy).values())
