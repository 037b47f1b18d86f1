"""Fuzz what the in-loop eval reads from outside: ``[eval] tasks`` entries (any text: a task or
one usage error naming the key) and the eval gate's state in a checkpoint's train state (any JSON
value: loaded as written, or one error naming the file)."""

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.checkpoint.state import CheckpointContents
from goodput.errors import ExitCode, GoodputError
from goodput.eval.choice_tasks import LAYOUTS
from goodput.eval.config import EvalConfig
from goodput.eval.gate import EvalGate
from goodput.testing import fuzz

task_texts = st.text(max_size=40) | st.builds(
    lambda layout, path: f"{layout}:{path}",
    st.sampled_from([*LAYOUTS, "mmlu", "", "ARC"]),
    st.text(max_size=20),
)


@given(st.lists(task_texts, max_size=4))
def test_task_entries_are_tasks_or_one_usage_error(tasks):
    try:
        specs = EvalConfig(interval_steps=10, holdout_samples=1, tasks=tuple(tasks)).task_specs()
    except GoodputError as error:
        assert error.code == ExitCode.USAGE and error.render().startswith("[eval] tasks[")
        assert "\n" not in error.render()
        return
    assert [f"{s.layout}:{s.path}" for s in specs] == tasks
    assert len({s.name for s in specs}) == len(specs)


GATE_STATES = fuzz.json_values("at_chance_in_a_row", 0, 3) | st.dictionaries(
    st.sampled_from(["at_chance_in_a_row", "x"]), fuzz.json_values(0, 7)
)


@given(state=GATE_STATES)
def test_gate_states_load_as_written_or_are_refused_naming_the_file(state):
    path = Path("RUN/checkpoints/step-00000001/train_state.json")  # only named, never read
    gate = EvalGate(3, False)
    contents = CheckpointContents(parts=[], optimizers=[], states={"gate": gate})
    try:
        contents.load_train_state({"eval_gate": state}, path)
    except GoodputError as error:
        assert error.render().startswith(f"{path}: damaged: eval_gate")
        return
    assert gate.state_dict() == {"eval_gate": state}
