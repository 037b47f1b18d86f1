"""Fuzz ``[parallel] fp8`` against the model's shape: the shipped tiny config with hostile widths,
head counts, feed-forward sizes, tp degrees and recipes as overrides.

Property: ``load_config`` refuses in one ``GoodputError`` line, or returns a config whose every
converted weight (train/parallel/float8.py) is a multiple of 16 in both dimensions on every
tensor-parallel rank, as FP8 matmuls need.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import event, given
from hypothesis import strategies as st

from goodput.config import load_config
from goodput.errors import GoodputError
from goodput.train.config.run import RunConfig

TINY = Path(__file__).parents[2] / "configs" / "tiny-cpu.toml"

# Half of each drawn from what loads, so that both outcomes are reached.
sizes = st.one_of(
    st.sampled_from([16, 48, 64, 128, 384]),
    st.sampled_from([0, -16, 1, 8, 24, 96, 2**31, 2**63]),
    st.integers(min_value=-(2**40), max_value=2**40),
)
recipes = st.one_of(
    st.sampled_from(['"rowwise"', '"tensorwise"']),
    st.sampled_from(['"blockwise"', "true", "8", '""', '"ROWWISE"']),
)
overrides = st.fixed_dictionaries(
    {
        "model.dim": sizes,
        "model.num_heads": st.sampled_from([1, 2, 4, 8, 0, -1]),
        "model.num_kv_heads": st.sampled_from([1, 2, 4, 8, 0]),
        "model.ffn_dim": sizes,
        "parallel.tp": st.sampled_from([1, 1, 2, 4, 3, 0]),
        "parallel.fp8": recipes,
        "parallel.fp8_emulate": st.sampled_from(["true", "false", "1", '"yes"']),
    }
)


@given(items=overrides)
def test_fp8_loads_only_a_model_it_can_split(items):
    try:
        cfg = load_config(RunConfig, TINY, [f"{key}={value}" for key, value in items.items()])
    except GoodputError as error:
        assert error.render().count("\n") == 0
        event("refused")
        return
    event("loaded")
    model, tp = cfg.model, cfg.parallel.tp
    assert cfg.parallel.fp8 in ("rowwise", "tensorwise")
    assert model.dim % 16 == 0 and model.mlp_dim % (16 * tp) == 0
    assert (model.num_heads * model.head_dim) % (16 * tp) == 0
    assert (model.kv_heads * model.head_dim) % (16 * tp) == 0
