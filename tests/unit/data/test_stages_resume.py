"""Resuming a staged blend: anywhere (on and across a stage boundary) and at another DP size
reads what the straight run reads, bit for bit; a stage not yet started may be appended or
changed without ``allow_data_change``; a started one may not, and is named."""

import re

import numpy as np
import pytest

from goodput.data.blend import BlendSpec, BlendStage, build_blend
from goodput.data.loader import DataLoader
from goodput.errors import GoodputError

GLOBAL_BATCH = 16


@pytest.fixture
def lists(three_corpora):
    file_list, _ = three_corpora
    data = file_list.parent
    (data / "stage1.txt").write_text("0.9 code code\n0.1 math math\n")
    (data / "stage2.txt").write_text("0.5 web_a web\n0.5 web_b web\n")
    (data / "stage2b.txt").write_text("0.5 web_a web\n0.3 web_b web\n0.2 code code\n")
    return file_list, data / "stage1.txt", data / "stage2.txt", data / "stage2b.txt"


def blend(tmp_path, stages, num_samples=512):
    spec = BlendSpec(
        stages=tuple(BlendStage(path, start) for start, path in stages),
        seq_len=16,
        num_samples=num_samples,
        seed=2,
        cache=tmp_path / "cache",
        step_samples=GLOBAL_BATCH,
    )
    return build_blend(spec)[0]


def batches(directory, dp_size, state=None, **resume):
    """Every remaining global batch, put together from the ranks' slices."""
    loaders = [
        DataLoader(directory, global_batch_size=GLOBAL_BATCH, dp_rank=r, dp_size=dp_size)
        for r in range(dp_size)
    ]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state, **resume)
    return [np.concatenate([x.numpy() for x, _ in parts]) for parts in zip(*loaders, strict=True)]


def state_at(directory, consumed):
    loader = DataLoader(directory, global_batch_size=GLOBAL_BATCH, dp_rank=0, dp_size=1)
    for _ in range(consumed // GLOBAL_BATCH):
        next(iter(loader))
    return loader.state_dict()


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_a_resume_anywhere_reads_what_the_straight_run_reads(lists, tmp_path, dp_size):
    stage0, stage1, stage2, _ = lists
    directory = blend(tmp_path, [(0, stage0), (128, stage1), (320, stage2)])
    straight = batches(directory, 1)
    assert len(straight) == 512 // GLOBAL_BATCH
    for consumed in (0, 112, 128, 144, 320, 336, 496):  # before, on and after each boundary
        resumed = batches(directory, dp_size, state_at(directory, consumed))
        expected = straight[consumed // GLOBAL_BATCH :]
        assert len(resumed) == len(expected)
        assert all((a == b).all() for a, b in zip(resumed, expected, strict=True))


@pytest.mark.parametrize("consumed", [128, 320, 400])
def test_a_stage_not_yet_started_may_be_appended_or_changed(lists, tmp_path, consumed):
    stage0, stage1, stage2, stage2b = lists
    before = blend(tmp_path, [(0, stage0), (128, stage1), (400, stage2)], num_samples=480)
    after = blend(tmp_path, [(0, stage0), (128, stage1), (400, stage2b), (448, stage2)])
    state = state_at(before, consumed)
    resumed = batches(after, 2, state)  # no allow_data_change
    assert all(
        (a == b).all() for a, b in zip(resumed, batches(after, 1)[consumed // 16 :], strict=True)
    )
    assert len(resumed) == (512 - consumed) // GLOBAL_BATCH


def test_a_plain_run_may_gain_stages_it_has_not_reached(lists, tmp_path):
    stage0, stage1, _, _ = lists
    plain = blend(tmp_path, [(0, stage0)], num_samples=256)
    staged = blend(tmp_path, [(0, stage0), (256, stage1)])
    resumed = batches(staged, 4, state_at(plain, 256))
    assert len(resumed) == 16 and all(
        (a == b).all() for a, b in zip(resumed, batches(staged, 1)[16:], strict=True)
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("moved", "stage 1 (file list {stage1}) started at sample 128"),
        ("reweighed", "stage 1 (file list {stage1}) started at sample 128"),
        ("removed", "stage 2 (removed) started at sample 320"),
        ("stage 0", r"(weights changed); resume with the blend the run started with"),
    ],
)
def test_a_change_to_a_started_stage_is_refused_naming_it(lists, tmp_path, change, message):
    stage0, stage1, stage2, _ = lists
    before = blend(tmp_path, [(0, stage0), (128, stage1), (320, stage2)])
    state = state_at(before, 336)
    if change == "reweighed":
        stage1.write_text("0.8 code code\n0.2 math math\n")
    if change == "stage 0":
        stage0.write_text("1 web_a web\n1 web_b web\n1 code code\n1 math math\n")
    stages = {
        "moved": [(0, stage0), (144, stage1), (320, stage2)],
        "removed": [(0, stage0), (128, stage1)],
    }.get(change, [(0, stage0), (128, stage1), (320, stage2)])
    after = blend(tmp_path, stages)
    loader = DataLoader(after, global_batch_size=GLOBAL_BATCH, dp_rank=0, dp_size=1)
    with pytest.raises(GoodputError, match=re.escape(message.format(stage1=stage1))) as refused:
        loader.load_state_dict(state)
    assert refused.value.code == 2 and "allow" in str(refused.value)
    loader.load_state_dict(state, allow_data_change=True)  # the explicit override
    assert loader.consumed_samples == 336


def test_an_unstarted_stage_is_checked_by_the_samples_consumed(lists, tmp_path):
    """A stage moved to a later start, past what was consumed, yet over samples the checkpoint
    read from it: the prefix digest notices."""
    stage0, stage1, _, _ = lists
    before = blend(tmp_path, [(0, stage0), (128, stage1)])
    after = blend(tmp_path, [(0, stage0), (256, stage1)])
    state = dict(state_at(before, 192))
    del state["stage_starts"]  # as a checkpoint that did not record them
    loader = DataLoader(after, global_batch_size=GLOBAL_BATCH, dp_rank=0, dp_size=1)
    with pytest.raises(GoodputError, match="first 192 samples are not those the checkpoint"):
        loader.load_state_dict(state)


@pytest.mark.parametrize(
    "name", ["stage abc", "stage -1", "stage 0", "stage 01", "stage 1 ", "stage"]
)
def test_a_checkpoint_naming_a_component_no_blend_has_is_refused(lists, tmp_path, name):
    """Component names come from the checkpoint: one that is not ``stage k`` (k >= 1) is a
    change the loader refuses, never a stage number it computes with."""
    stage0, stage1, _, _ = lists
    directory = blend(tmp_path, [(0, stage0), (128, stage1)])
    state = dict(state_at(directory, 64))
    state["components"] = {**state["components"], name: "0" * 16}
    state["fingerprint"] = "f" * 16
    loader = DataLoader(directory, global_batch_size=GLOBAL_BATCH, dp_rank=0, dp_size=1)
    with pytest.raises(GoodputError, match="resume with the blend the run started with") as refused:
        loader.load_state_dict(state)
    assert refused.value.code == 2 and name.strip() in str(refused.value)
