"""Fuzz ``runfiles.read_stage_mixtures``, the report's reader of run.json's ``data.stages``: any
JSON under the stage and share keys gives stages whose numbers hold their kinds, or one
GoodputError line; what the trainer writes (``StageMixture.as_json``) reads back equal."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from goodput import runfiles
from goodput.testing import fuzz

values = fuzz.json_values(0, 1, -1, 0.5, 1.5, 1 << 62, True, "", "web", "a.txt")
shares = st.dictionaries(st.sampled_from([*runfiles.SHARE_KEYS, "extra"]), values, max_size=5)
stage_objects = st.fixed_dictionaries(
    {}, optional={"start_step": values, "file_list": values, "corpora": st.lists(shares | values)}
)
records = (
    st.fixed_dictionaries(
        {},
        optional={"data": st.fixed_dictionaries({}, optional={"stages": st.lists(stage_objects)})},
    )
    | values
)


@given(records)
def test_any_record_reads_or_is_refused(record):
    stages = fuzz.result_or_refusal(runfiles.read_stage_mixtures, record, "run.json")
    for stage in stages or []:
        assert type(stage.start_step) is int and stage.start_step >= 0 and stage.file_list
        for share in stage.corpora:
            assert 0 <= share.target <= 1 and 0 <= share.achieved <= 1
            assert math.isfinite(share.achieved) and type(share.wrapped) is bool


finite_shares = st.floats(0, 1)
written = st.builds(
    runfiles.StageMixture,
    start_step=st.integers(0, runfiles.MAX_COUNT - 1),
    file_list=st.text(min_size=1, max_size=50),
    corpora=st.lists(
        st.builds(runfiles.CorpusShare, st.text(min_size=1, max_size=20), finite_shares,
                  finite_shares, st.booleans()),
        max_size=4,
    ).map(tuple),
)  # fmt: skip


@given(st.lists(written, max_size=3))
def test_what_the_trainer_writes_reads_back(stages):
    record = {"data": {"stages": [stage.as_json() for stage in stages]}}
    assert runfiles.read_stage_mixtures(record, "run.json") == stages
