import json

import numpy as np
import pytest
import torch

from goodput.data import prefix
from goodput.data.blend import BlendSpec, BlendStage, build_blend
from goodput.data.loader import BlendedSamples, DataLoader
from goodput.errors import GoodputError
from goodput.testing.dist import run_distributed


def blend_of(three_corpora, tmp_path, num_samples=512, seed=3):
    file_list, _ = three_corpora
    spec = BlendSpec(
        stages=(BlendStage(file_list, 0),),
        seq_len=32,
        num_samples=num_samples,
        seed=seed,
        cache=tmp_path / "cache",
    )
    return build_blend(spec)[0]


@pytest.fixture
def blend_dir(three_corpora, tmp_path):
    return blend_of(three_corpora, tmp_path)


def global_batches(blend_dir, num_batches, batch_size=8):
    samples = BlendedSamples(blend_dir)
    return [
        torch.stack([torch.from_numpy(samples[b * batch_size + i]) for i in range(batch_size)])
        for b in range(num_batches)
    ]


def test_single_rank_yields_shifted_inputs_and_labels(blend_dir):
    loader = DataLoader(blend_dir, global_batch_size=8, dp_rank=0, dp_size=1)
    batches = list(loader)
    assert len(batches) == 512 // 8
    expected = global_batches(blend_dir, 2)
    for (input_ids, labels), tokens in zip(batches[:2], expected, strict=True):
        assert input_ids.dtype == torch.int64 and input_ids.shape == (8, 32)
        assert torch.equal(input_ids, tokens[:, :-1]) and torch.equal(labels, tokens[:, 1:])


def rank_batches(rank, world_size, blend_dir, num_batches):
    loader = DataLoader(blend_dir, global_batch_size=8, dp_rank=rank, dp_size=world_size)
    iterator = iter(loader)
    return [next(iterator)[0] for _ in range(num_batches)], loader.state_dict()


def test_ranks_split_each_global_batch_exactly(blend_dir):
    per_rank = run_distributed(rank_batches, 2, blend_dir, 3)
    expected = global_batches(blend_dir, 3)
    for b in range(3):
        assert torch.equal(torch.cat([per_rank[0][0][b], per_rank[1][0][b]]), expected[b][:, :-1])
    assert per_rank[0][1]["consumed_samples"] == per_rank[1][1]["consumed_samples"] == 24


def test_resume_at_another_dp_size_continues_the_global_sequence(blend_dir):
    four_ranks = [rank_batches(rank, 4, blend_dir, 2) for rank in range(4)]
    state = four_ranks[0][1]
    resumed = DataLoader(blend_dir, global_batch_size=8, dp_rank=0, dp_size=1)
    resumed.load_state_dict(state)
    input_ids, _ = next(iter(resumed))
    assert torch.equal(input_ids, global_batches(blend_dir, 3)[2][:, :-1])


def test_fingerprint_mismatch_names_what_changed(blend_dir, three_corpora, tmp_path):
    loader = DataLoader(blend_dir, global_batch_size=8, dp_rank=0, dp_size=1)
    state = loader.state_dict()
    file_list, _ = three_corpora
    other, _ = build_blend(
        BlendSpec(
            stages=(BlendStage(file_list, 0),),
            seq_len=32,
            num_samples=512,
            seed=4,
            cache=tmp_path / "cache",
        )
    )
    other_loader = DataLoader(other, global_batch_size=8, dp_rank=0, dp_size=1)
    with pytest.raises(GoodputError, match=r"\(seed changed\)"):
        other_loader.load_state_dict(state)
    other_loader.load_state_dict({**state, "consumed_samples": 16}, allow_data_change=True)
    assert other_loader.consumed_samples == 16


def test_edited_manifest_and_changed_shard_are_refused(blend_dir, three_corpora):
    manifest_path = blend_dir / "blend.json"
    original = manifest_path.read_text()
    manifest = json.loads(original)
    manifest["weights"][0][1] = 0.9
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(GoodputError, match="weights edited after the blend was built"):
        BlendedSamples(blend_dir)
    manifest_path.write_text(original)
    file_list, _ = three_corpora
    (file_list.parent / "math.bin").write_bytes(b"\0\0" * 10)
    with pytest.raises(GoodputError, match="math.bin"):
        BlendedSamples(blend_dir)


def test_batch_must_divide_over_ranks(blend_dir):
    with pytest.raises(GoodputError, match="not a positive multiple"):
        DataLoader(blend_dir, global_batch_size=6, dp_rank=0, dp_size=4)


@pytest.fixture
def saved_at_40(blend_dir, monkeypatch):
    """The state of a loader that consumed 40 samples (5 batches), chained in links of 16 so
    that whole links and a rest are both checked."""
    monkeypatch.setattr(prefix, "LINK", 16)
    loader = DataLoader(blend_dir, global_batch_size=8, dp_rank=0, dp_size=1)
    batches = iter(loader)
    for _ in range(5):
        next(batches)
    return loader.state_dict()


def test_a_longer_blend_resumes_where_the_shorter_one_stopped(
    blend_dir, saved_at_40, three_corpora, tmp_path
):
    longer = DataLoader(
        blend_of(three_corpora, tmp_path, num_samples=1024),
        global_batch_size=8,
        dp_rank=0,
        dp_size=1,
    )
    longer.load_state_dict(saved_at_40)  # no allow_data_change: only the length changed
    assert longer.state_dict()["prefix"] == saved_at_40["prefix"]
    input_ids, _ = next(iter(longer))
    assert torch.equal(input_ids, global_batches(blend_dir, 6)[5][:, :-1])
    shorter = DataLoader(blend_dir, global_batch_size=8, dp_rank=0, dp_size=1)
    shorter.load_state_dict(longer.state_dict())  # shortened, yet past what was consumed
    assert shorter.consumed_samples == 48


def test_a_resume_in_the_same_blend_carries_the_digest_on(blend_dir, saved_at_40):
    straight = DataLoader(blend_dir, global_batch_size=8, dp_rank=0, dp_size=1)
    straight.consumed_samples = 200
    resumed = DataLoader(blend_dir, global_batch_size=8, dp_rank=0, dp_size=1)
    resumed.load_state_dict(saved_at_40)
    resumed.consumed_samples = 200
    assert resumed.state_dict() == straight.state_dict()


def other_blend(three_corpora, tmp_path, **changes):
    directory = blend_of(three_corpora, tmp_path, **changes)
    return DataLoader(directory, global_batch_size=8, dp_rank=0, dp_size=1)


@pytest.mark.parametrize(
    ("changes", "edit", "message"),
    [
        ({}, {"sha256": "0" * 64}, "first 40 samples are not those the checkpoint consumed"),
        ({}, None, "saved by an older goodput, records no digest"),
        ({"num_samples": 32}, {}, "the blend has 32 samples, the checkpoint used 40"),
        ({"seed": 4}, {}, r"\(num_samples, seed changed\); resume with"),
    ],
    ids=["prefix-differs", "no-record", "shrunk-below-consumed", "seed-too"],
)
def test_a_longer_blend_is_refused_unless_it_starts_with_what_was_consumed(
    saved_at_40, three_corpora, tmp_path, changes, edit, message
):
    state = dict(saved_at_40)
    if edit is None:
        del state["prefix"]
    else:
        state["prefix"] = {**state["prefix"], **edit}
    loader = other_blend(three_corpora, tmp_path, **{"num_samples": 1024, **changes})
    with pytest.raises(GoodputError, match=message) as refused:
        loader.load_state_dict(state)
    assert refused.value.what.startswith("data fingerprint differs from the checkpoint's")
    if len(loader.samples) < 40:  # no change is allowed a position past the blend's end
        with pytest.raises(ValueError, match="past the end of the blend"):
            loader.load_state_dict(state, allow_data_change=True)
        return
    loader.load_state_dict(state, allow_data_change=True)
    assert loader.consumed_samples == 40


def test_a_damaged_prefix_record_is_refused_by_field(blend_dir, saved_at_40):
    loader = DataLoader(blend_dir, global_batch_size=8, dp_rank=0, dp_size=1)
    state = {**saved_at_40, "prefix": {"chain": "xyz", "sha256": "0" * 64}}
    with pytest.raises(GoodputError, match="field loader.prefix.chain must be a sha256 hex digest"):
        loader.load_state_dict(state)


def test_identities_name_each_samples_corpus_and_number_in_it(blend_dir):
    samples = BlendedSamples(blend_dir)
    raw = samples.identities(10, 20)
    corpora = np.frombuffer(raw[:20], "<i2")
    within = np.frombuffer(raw[20:], "<i8")
    for k, i in enumerate(range(10, 20)):
        order = samples.corpus_orders[corpora[k]]
        assert corpora[k] == samples.corpus_index[i]
        assert within[k] == order[samples.sample_index[i]]
