"""QK-clip on the model: after a clip, the same inputs give no head a logit above tau, heads
below it are left alone, and FSDP-sharded query weights are clipped as whole ones are. One
layer: a clip of layer 0 changes what layer 1 sees, so only one layer's inputs stay the same."""

import math
from dataclasses import replace

import torch
from torch.distributed.fsdp import fully_shard

from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL
from goodput.train.model import Transformer, max_logits
from goodput.train.optim import qk_clip

TAU = 0.06
MODEL = replace(TINY_MODEL, num_layers=1)


def model_and_batch():
    torch.manual_seed(0)
    model = Transformer(MODEL)
    with torch.no_grad():  # grow some heads' logits past tau, as a long run would
        for block in model.blocks.values():
            block.attention.wq.weight[: MODEL.head_dim].mul_(4.0)
    batch = torch.randint(0, MODEL.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    return model, batch


def tracked(model, batch):
    qk_clip.track_logits([model])
    model(batch)
    return [a.max_logit_h.clone() for a in qk_clip.attentions([model])]


def test_max_logits_is_the_causal_maximum_of_q_dot_k():
    q = torch.randn(2, 4, 9, 8)
    k = torch.randn(2, 2, 9, 8)
    k_full = k.repeat_interleave(2, dim=1)
    logits = q @ k_full.transpose(-1, -2) / math.sqrt(8)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    expected = logits.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))
    assert torch.allclose(max_logits(q, k), expected)


def test_after_a_clip_no_head_passes_tau_and_the_others_are_untouched():
    model, batch = model_and_batch()
    before = tracked(model, batch)
    assert all(float(h[0]) > TAU for h in before)  # the grown heads
    grown = [h > TAU for h in before]
    weights = [a.wq.weight.detach().clone() for a in qk_clip.attentions([model])]
    largest = qk_clip.clip([model], TAU, None, None)
    assert largest == max(float(h.max()) for h in before)
    after = tracked(model, batch)
    for h_before, h_after, mask, weight, attention in zip(
        before, after, grown, weights, qk_clip.attentions([model]), strict=True
    ):
        assert torch.allclose(h_after[mask], torch.full_like(h_after[mask], TAU), rtol=1e-4)
        assert torch.equal(h_after[~mask], h_before[~mask])
        rows = mask.repeat_interleave(MODEL.head_dim)
        assert torch.equal(attention.wq.weight[~rows], weight[~rows])
        assert not torch.equal(attention.wq.weight[rows], weight[rows])


def clipped_on_rank(rank, world_size):
    model, batch = model_and_batch()
    for block in model.blocks.values():
        fully_shard(block)
    fully_shard(model)
    qk_clip.track_logits([model])
    model(batch)
    qk_clip.clip([model], TAU, None, None)
    return {a: w.full_tensor() for a, w in model.state_dict().items() if "wq" in a}


def test_fsdp_sharded_query_weights_are_clipped_as_whole_ones():
    model, batch = model_and_batch()
    tracked(model, batch)
    qk_clip.clip([model], TAU, None, None)
    expected = {name: w for name, w in model.state_dict().items() if "wq" in name}
    for result in run_distributed(clipped_on_rank, 2):
        assert result.keys() == expected.keys()
        for name in expected:
            assert torch.allclose(result[name], expected[name], atol=1e-7), name
