"""The trainer's own entries in a checkpoint's train_state.json — the LR reference, the
gradient-noise-scale averages and the loss-spike window — are outside input on resume: a damaged
or hostile value is refused naming the file, never loaded."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from goodput.checkpoint.load import check_train_state
from goodput.checkpoint.state import CheckpointContents
from goodput.errors import GoodputError
from goodput.train.config.run import DiagnosticsConfig
from goodput.train.monitor.diagnostics import RunningDiagnostics

PATH = Path("step-00000008/train_state.json")
VALID = {
    "step": 8,
    "world_size": 2,
    "loader": {"consumed_samples": 64, "fingerprint": "abc", "components": {}},
    "optimizer_param_groups": [{"lr": 0.1, "params": ["w"]}],
    "lr_reference_tokens": 128,
    "noise_scale": {"steps": 8, "gradient_sq": 0.5, "trace": 120.0},
    "loss_spikes": {"losses": [4.1, 4.0, 3.9]},
}


def checked(state):
    """The train state as a resume reads it: the checkpoint's checks, then the loop's."""
    state = check_train_state(state, PATH)
    states = {"diagnostics": RunningDiagnostics(DiagnosticsConfig())}
    CheckpointContents(parts=[], optimizers=[], states=states).load_train_state(state, PATH)
    return state


def test_a_state_goodput_wrote_is_accepted():
    assert checked(json.loads(json.dumps(VALID))) == VALID


def test_states_from_before_the_diagnostics_are_accepted():
    older = {
        k: v
        for k, v in VALID.items()
        if k not in ("lr_reference_tokens", "noise_scale", "loss_spikes")
    }
    assert checked(older) == older


@pytest.mark.parametrize(
    ("key", "value", "phrase"),
    [
        ("lr_reference_tokens", 0, "lr_reference_tokens"),
        ("lr_reference_tokens", True, "lr_reference_tokens"),
        ("lr_reference_tokens", 1.5, "lr_reference_tokens"),
        ("lr_reference_tokens", "128", "lr_reference_tokens"),
        ("noise_scale", [1, 2], "noise scale"),
        ("noise_scale", {"steps": -1, "gradient_sq": 0.5, "trace": 1.0}, "'steps'"),
        ("noise_scale", {"steps": 1, "gradient_sq": 1e999, "trace": 1.0}, "'gradient_sq'"),
        ("noise_scale", {"steps": 1, "gradient_sq": 0.5, "trace": 1.0, "x": 1}, "unknown key"),
        ("loss_spikes", {"losses": "4.0"}, "loss"),
        ("loss_spikes", {"losses": [4.0] * 70_000}, "loss"),
        ("loss_spikes", {"losses": [None]}, "loss"),
    ],
)
def test_a_damaged_entry_is_refused_naming_the_file(key, value, phrase):
    with pytest.raises(GoodputError) as caught:
        checked({**VALID, key: value})
    line = str(caught.value)
    assert str(PATH) in line and phrase in line and "\n" not in line


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    key=st.sampled_from(["lr_reference_tokens", "noise_scale", "loss_spikes"]),
    value=JSON,
)
def test_any_value_of_the_diagnostics_entries_is_accepted_or_refused_cleanly(key, value):
    try:
        checked({**VALID, key: value})
    except GoodputError as error:
        assert str(PATH) in str(error)
