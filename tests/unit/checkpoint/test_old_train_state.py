"""An old checkpoint's train state resumes whole: the parts registered with the checkpointer read
every entry of a ``train_state.json`` written before they were registered, and write the same
entries back under the same keys."""

from pathlib import Path

from goodput.checkpoint.load import check_train_state
from goodput.checkpoint.state import CheckpointContents
from goodput.eval.gate import EvalGate
from goodput.testing.tiny import tiny_run_config
from goodput.train.monitor.diagnostics import RunningDiagnostics
from goodput.train.optim.lr_scale import LrScale
from goodput.train.resume import LoaderState
from goodput.train.step import SkippedSteps

PATH = Path("step-00000004/train_state.json")
# Written by goodput 0405c79 (a tiny run on 2 ranks, at step 4), the parameter names cut short.
# The counters, 0 there, are set off their defaults here so that a key read under another name
# shows: it would come back as the default.
OLD = {
    "eval_gate": {"at_chance_in_a_row": 2},
    "loader": {
        "components": {
            "format": "85256d26299edb42",
            "holdout_samples": "4b227777d4dd1fc6",
            "num_samples": "a68b412c4282555f",
            "on_exhausted": "b578280bb4112d68",
            "seed": "03ac674216f3e15c",
            "seq_len": "b17ef6d19c7a5b1e",
            "shards": "ed3b9ae02cb3be3c",
            "tokenizer": "74234e98afe7498f",
            "weights": "ac0a507f5e3f1597",
        },
        "consumed_samples": 32,
        "fingerprint": "e2b354a2e574649182c0cfd378e630e3de1e5c75cf63f5b612327b6a6e615f35",
        "prefix": {
            "chain": "2f7183e01514c8c383d30b4d74547f8f505cb9ba84116027266c5de5aa7b265a",
            "sha256": "7ef392e0768a4e57fa7a9fc79cc2d16daad61a53a9a0f60c9b5e5d4c84199442",
        },
    },
    "loss_spikes": {
        "losses": [4.123600006103516, 3.994509696960449, 3.9605722427368164, 3.750000476837158]
    },
    "lr_reference_tokens": 256,
    "noise_scale": {"gradient_sq": 0.012342516026379874, "steps": 4, "trace": 2.8459640096951446},
    "optimizer_param_groups": [
        {
            "amsgrad": False,
            "betas": [0.9, 0.95],
            "capturable": False,
            "decoupled_weight_decay": True,
            "differentiable": False,
            "eps": 1e-08,
            "foreach": True,
            "fused": None,
            "lr": 0.009397114317029975,
            "maximize": False,
            "params": ["embedding.weight", "blocks.0.attention.wq.weight"],
            "weight_decay": weight_decay,
        }
        for weight_decay in (0.1, 0.0)
    ],
    "skipped_in_a_row": 1,
    "skipped_steps": 3,
    "step": 4,
    "world_size": 2,
}
# What the checkpointer writes itself, beside the registered parts' entries.
CHECKPOINTER_KEYS = {"step", "world_size", "optimizer_param_groups"}


class RecordedLoader:
    """Stands in for the data loader (whose own round trip is tests/unit/data/test_loader.py's):
    keeps the position it is handed."""

    def __init__(self) -> None:
        self.state = None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state, *, allow_data_change, steps_left):
        self.state = state


def test_the_registered_parts_read_an_old_train_state_and_write_it_back(tmp_path):
    cfg = tiny_run_config(tmp_path)
    states = {
        "loader": LoaderState(RecordedLoader(), allow_data_change=False, steps=cfg.train.steps),
        "skips": SkippedSteps(cfg.train.max_skipped_steps),
        "lr_scale": LrScale(cfg),
        "diagnostics": RunningDiagnostics(cfg.diagnostics),
        "eval_gate": EvalGate(cfg.eval.alarm_evals, cfg.eval.stop_on_alarm),
    }
    contents = CheckpointContents(parts=[], optimizers=[], states=states)
    contents.load_train_state(check_train_state(OLD, PATH), PATH)
    written = contents.train_state()
    assert written == {key: value for key, value in OLD.items() if key not in CHECKPOINTER_KEYS}
    assert states["lr_scale"].reference_tokens == 256 and states["skips"].in_a_row == 1
