"""Fuzz the train state a resume reads, by both of its paths: a checkpoint's
``train_state.json`` (``io.read_json``, then ``load.check_train_state``) and the train state in
an in-memory checkpoint's manifest (``snapshot.format.parse_manifest``, which calls the same
checker); then what is checked against the run itself: the saved optimizer groups against its
optimizer (``parts.check_param_groups``).

Property: a train state with one key replaced by a value of any type or range, or removed, is
accepted only if that value is valid for that key (an oracle restating each key's rule), and
otherwise refused with one ``GoodputError`` line naming the file and the key.
"""

from __future__ import annotations

import copy
import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from goodput.checkpoint.load import MAX_STEP, MAX_WORLD, check_train_state
from goodput.checkpoint.parts import check_param_groups
from goodput.checkpoint.snapshot.format import manifest_bytes, parse_manifest
from goodput.errors import GoodputError
from goodput.io import read_json
from goodput.testing.fuzz import json_values
from goodput.testing.snapshots import sample_manifest

MAX_COUNT = 1 << 40
HEX64 = re.compile(r"[0-9a-f]{64}")
# A train state as the trainer writes it (a tiny run, at step 4, on 2 ranks).
VALID: dict[str, Any] = {
    "step": 4,
    "world_size": 2,
    "loader": {
        "consumed_samples": 32,
        "fingerprint": "e2b354a2e574649182c0cfd378e630e3de1e5c75cf63f5b612327b6a6e615f35",
        "components": {"seed": "03ac674216f3e15c", "shards": "ed3b9ae02cb3be3c"},
        "prefix": {"chain": "2f" * 32, "sha256": "7e" * 32},
        "stage_starts": [0],
    },
    "skipped_steps": 3,
    "skipped_in_a_row": 1,
    "lr_reference_tokens": 256,
    "optimizer_param_groups": [
        {
            "lr": 0.009,
            "betas": [0.9, 0.95],
            "eps": 1e-08,
            "weight_decay": 0.1,
            "amsgrad": False,
            "fused": None,
            "params": ["embedding.weight", "norm.weight"],
        }
    ],
    "noise_scale": {"gradient_sq": 0.01, "steps": 4, "trace": 2.8},
}


def _count(low: int = 0, high: float = math.inf):
    return lambda v: type(v) is int and low <= v <= high


def _hyper_parameter(value: Any) -> bool:
    if type(value) in (int, float):
        return math.isfinite(value) and value >= 0
    return value is None or isinstance(value, bool | str)


def _hex64(value: Any) -> bool:
    return isinstance(value, str) and HEX64.fullmatch(value) is not None


def _names(value: Any) -> bool:
    return (
        isinstance(value, list)
        and all(isinstance(n, str) for n in value)
        and len(set(value)) == len(value)
    )


MISSING = object()
# Each key's rule, restated from what the trainer writes: whether ``value`` may stand there
# (MISSING: the key removed).
RULES: dict[tuple[Any, ...], Any] = {
    ("step",): _count(0, MAX_STEP),
    ("world_size",): _count(1, MAX_WORLD),
    ("model_only",): lambda v: v is MISSING or type(v) is bool,
    ("loader",): lambda v: False,  # replaced whole by a random value: never a loader state
    ("loader", "consumed_samples"): _count(),
    ("loader", "fingerprint"): lambda v: isinstance(v, str),
    ("loader", "components"): lambda v: (
        isinstance(v, dict) and all(isinstance(x, str) for x in v.values())
    ),
    ("loader", "prefix"): lambda v: v is MISSING or v is None,
    ("loader", "prefix", "chain"): _hex64,
    ("loader", "stage_starts"): lambda v: (
        v is MISSING or (isinstance(v, list) and all(_count()(x) for x in v))
    ),
    ("skipped_steps",): lambda v: _count(1, MAX_STEP)(v),  # >= skipped_in_a_row (1)
    ("skipped_in_a_row",): lambda v: v is MISSING or _count(0, 3)(v),  # <= skipped_steps
    ("lr_reference_tokens",): lambda v: v is MISSING or _count(1, MAX_COUNT)(v),
    ("optimizer_param_groups",): lambda v: v == [],
    # Missing: the run's optimizer's own value stands (parts.check_param_groups).
    ("optimizer_param_groups", 0, "lr"): lambda v: (
        v is MISSING
        or (_hyper_parameter(v) or (isinstance(v, list) and all(_hyper_parameter(x) for x in v)))
    ),
    ("optimizer_param_groups", 0, "params"): _names,
    ("noise_scale",): lambda v: True,  # its part's own entry: checked when the part loads it
    ("unknown key",): lambda v: True,  # passed over, as a newer writer's would be
}
# What the message names for each key.
NAMED = {
    ("loader",): "loader",
    ("optimizer_param_groups", 0, "lr"): "optimizer_param_groups[0].lr",
    ("optimizer_param_groups", 0, "params"): "optimizer_param_groups[0].params",
}

values = (
    json_values(-1, 0, 1, 2**40, 2**40 + 1, 2**24 + 1, 1.5, -0.5, "4", "f" * 64, [], {})
    | st.sampled_from([math.nan, math.inf, -math.inf, True, False, None, [0.9, -1.0]])
    | st.just(MISSING)
)


def edited(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    state = copy.deepcopy(VALID)
    parent = state
    for key in path[:-1]:
        parent = parent[key]
    if value is MISSING:
        parent.pop(path[-1], None)
    else:
        parent[path[-1]] = value
    return state


def valid(path: tuple[Any, ...], value: Any) -> bool:
    if path == ("model_only",) and value is True:
        return True  # a model-only checkpoint holds nothing else that is read
    if value is MISSING and path[-1] in ("step", "world_size", "consumed_samples", "params"):
        return False
    if value is MISSING and path in (("loader",), ("optimizer_param_groups",)):
        return False
    return RULES[path](value)


def names_the_key(error: GoodputError, path: tuple[Any, ...]) -> bool:
    key = NAMED.get(path, ".".join(str(part) for part in path))
    pair = ("skipped_steps", "skipped_in_a_row")  # one rule: in a row <= in all
    return (
        key in error.what
        or (path[0] in pair and all(name in error.what for name in pair))
        or (path[:1] == ("loader",) and "field loader" in error.what)
    )


def accepted_only_if_valid(read: Any, where: str, path: tuple[Any, ...], value: Any) -> None:
    try:
        read()
    except GoodputError as error:
        assert not valid(path, value), f"{path} = {value!r} refused: {error}"
        assert "\n" not in error.render() and error.where == where, error.render()
        assert names_the_key(error, path), error.render()
    else:
        assert valid(path, value), f"{path} = {value!r} accepted"


@given(path=st.sampled_from(sorted(RULES, key=str)), value=values)
def test_a_checkpoints_train_state_json(tmp_path_factory, path, value):
    file = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp())) / "train_state.json"
    file.write_text(json.dumps(edited(path, value)))  # NaN and Infinity too: read_json takes them

    accepted_only_if_valid(lambda: check_train_state(read_json(file), file), str(file), path, value)


WHERE = "held-00001.slot-0.json"


@given(path=st.sampled_from(sorted(RULES, key=str)), value=values)
def test_a_memory_snapshots_train_state(path, value):
    if path == ("model_only",) and value is True:
        return  # a snapshot is never model-only: refused for that (its own test)
    manifest, _ = sample_manifest()
    raw = json.loads(manifest_bytes(manifest))
    raw["train_state"] = {**edited(path, value), "step": raw["step"]}
    if path == ("step",):
        raw["train_state"] = edited(path, value)
        raw["step"] = value if _count(0, MAX_STEP)(value) else raw["step"]
    data = json.dumps(raw, allow_nan=False).encode() if _finite(raw) else None
    if data is None:
        return  # a manifest is strict JSON: NaN is refused before the train state is read
    accepted_only_if_valid(lambda: parse_manifest(data, WHERE), WHERE, path, value)


def _finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def optimizer() -> torch.optim.Optimizer:
    weights = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    return torch.optim.AdamW(
        [{"params": weights[:1]}, {"params": weights[1:], "weight_decay": 0.0}], lr=0.01
    )


@given(key=st.sampled_from(["lr", "betas", "eps", "amsgrad", "fused", "foreach"]), value=values)
def test_saved_optimizer_groups_against_the_runs_optimizer(optimizer, key, value):
    """A saved hyper-parameter of another kind than this run's optimizer holds is refused
    naming it; one the file lacks keeps the run's value; numbers may be ints or floats."""
    own = optimizer.param_groups
    saved = [{k: v for k, v in group.items() if k != "params"} for group in own]
    if value is MISSING:
        del saved[1][key]
    else:
        saved[1][key] = value
    source = Path("step-00000004/train_state.json")

    def kind(v: Any) -> Any:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return type(v)
        if isinstance(v, int | float):
            return float
        return [kind(x) for x in v] if isinstance(v, list | tuple) else type(v)

    fits = value is MISSING or kind(value) == kind(own[1][key])
    try:
        check_param_groups([optimizer], saved, source)
    except GoodputError as error:
        assert not fits and error.where == str(source)
        assert f"optimizer_param_groups[1].{key}" in error.what
    else:
        assert fits
