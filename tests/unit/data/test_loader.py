import json

import pytest
import torch

from goodput.data.blend import BlendSpec, build_blend
from goodput.data.loader import BlendedSamples, DataLoader
from goodput.errors import GoodputError
from goodput.testing.dist import run_distributed


@pytest.fixture
def blend_dir(three_corpora, tmp_path):
    file_list, _ = three_corpora
    directory, _ = build_blend(
        BlendSpec(
            file_list=file_list, seq_len=32, num_samples=512, seed=3, output=tmp_path / "cache"
        )
    )
    return directory


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
            file_list=file_list, seq_len=32, num_samples=512, seed=4, output=tmp_path / "cache"
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
