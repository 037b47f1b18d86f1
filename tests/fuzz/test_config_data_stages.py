"""Fuzz the ``[[data.stages]]`` table parser: arrays of stage tables with hostile keys and values
against ``RunConfig``. Property: a config whose stages start at 0, increase and end inside the
run, one file list each; or one usage error on one line."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.testing.stages import load_tiny_cpu

TOKENS_PER_STEP = 2048


starts = st.one_of(
    st.integers(-5, 200), st.floats(allow_nan=True), st.booleans(), st.text(max_size=4),
    st.just(2**70),
)  # fmt: skip
stage_tables = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "file_list": st.one_of(st.text(max_size=5), st.integers()),
            "start_step": starts,
            "start_tokens": starts.map(lambda v: v * TOKENS_PER_STEP if type(v) is int else v),
            "extra": st.integers(),
        },
    ),
    max_size=5,
)


@given(stages=stage_tables)
def test_the_stages_table_parser_reads_or_refuses_anything(tmp_path_factory, stages):
    def inline(table: dict) -> str:
        values = (f"{key} = {json.dumps(value) if value == value else 'nan'}" for key, value
                  in table.items())  # fmt: skip
        return "{" + ", ".join(values).replace("Infinity", "inf") + "}"

    text = f"[data]\nstages = [{', '.join(inline(t) for t in stages)}]"
    try:
        folder = tmp_path_factory.mktemp("fuzz")
        cfg = load_tiny_cpu(folder, text, (f"train.tokens_per_step={TOKENS_PER_STEP}",))
    except GoodputError as error:
        assert error.code == 2 and "\n" not in error.render()
        return
    steps = cfg.stage_steps()
    assert steps[0] == 0 and list(steps) == sorted(set(steps)) and steps[-1] < cfg.train.steps
    assert len(steps) == len(cfg.data.file_lists()) == len(stages)
