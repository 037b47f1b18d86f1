"""The model's parts checked against what they must compute, not against themselves."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from goodput.errors import GoodputError
from goodput.train.config.model import ModelConfig, MoEConfig
from goodput.train.model import MoE, RMSNorm, Transformer, apply_rope, rope_frequencies


def tiny(**overrides):
    values = {
        "vocab_size": 97,
        "dim": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "ffn_dim": 64,
    }
    return ModelConfig(**{**values, **overrides})


def test_logits_shape_and_fresh_loss_near_ln_vocab():
    torch.manual_seed(0)
    model = Transformer(tiny())
    tokens = torch.randint(0, 97, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 97)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - math.log(97)) < 0.1


def test_causal_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    model = Transformer(tiny())
    tokens = torch.randint(0, 97, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 97
    assert torch.allclose(model(tokens)[0, :8], model(changed)[0, :8], atol=1e-6)
    assert not torch.allclose(model(tokens)[0, 8:], model(changed)[0, 8:])


def test_rope_scores_depend_only_on_relative_position():
    cfg = tiny()
    inv_freq = rope_frequencies(cfg)
    q, k = torch.randn(1, 1, 1, cfg.head_dim), torch.randn(1, 1, 1, cfg.head_dim)

    def rotated(x, position):
        angles = torch.tensor([[float(position)]]) * inv_freq[None, :]
        return apply_rope(x, angles.cos(), angles.sin())

    score = (rotated(q, 7) * rotated(k, 3)).sum()
    assert torch.allclose(score, (rotated(q, 104) * rotated(k, 100)).sum(), atol=1e-5)
    assert torch.allclose(rotated(q, 0), q)


def test_rope_scaling_slows_rotation():
    base = rope_frequencies(tiny())
    assert torch.allclose(
        rope_frequencies(tiny(rope_scaling="linear", rope_scaling_factor=4)), base / 4
    )
    llama3 = rope_frequencies(
        tiny(rope_scaling="llama3", rope_scaling_factor=8, rope_original_max_seq_len=64)
    )
    assert torch.allclose(llama3[0], base[0])  # the fastest rotation is kept
    assert torch.allclose(llama3[-1], base[-1] / 8)  # the slowest is slowed by the factor


def test_gqa_equals_attention_with_repeated_kv_heads():
    torch.manual_seed(0)
    grouped = Transformer(tiny(num_kv_heads=2))
    full = Transformer(tiny(num_kv_heads=4))
    state = grouped.state_dict()
    for name, value in list(state.items()):
        if name.endswith(("wk.weight", "wv.weight")):  # kv head j serves query heads 2j, 2j+1
            state[name] = value.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    full.load_state_dict(state)
    tokens = torch.randint(0, 97, (2, 10))
    assert torch.allclose(grouped(tokens), full(tokens), atol=1e-5)


def test_rmsnorm_and_tied_embeddings_and_depth_scaled_init():
    norm = RMSNorm(8, 1e-6)
    x = torch.randn(4, 8) * 5
    assert torch.allclose(norm(x).pow(2).mean(-1), torch.ones(4), atol=1e-4)
    tied = Transformer(tiny(tie_embeddings=True))
    assert tied.output.weight is tied.embedding.weight
    model = Transformer(tiny(num_layers=8, dim=256, num_heads=4, num_kv_heads=4, ffn_dim=512))
    attention = model.blocks["0"].attention
    ratio = attention.wo.weight.std() / attention.wq.weight.std()
    assert abs(ratio.item() - 1 / 4) < 0.02  # 1/sqrt(2 * 8 layers)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_heads": 5}, "dim 32 is not divisible by num_heads 5"),
        ({"num_kv_heads": 3}, "not a multiple of num_kv_heads 3"),
        ({"dim": 36, "num_heads": 4}, "head dim 9 is odd"),
        ({"moe": MoEConfig(num_experts=2, top_k=3)}, "moe.top_k 3 must be in"),
    ],
)
def test_bad_shapes_are_config_errors(overrides, message):
    with pytest.raises(GoodputError, match=message):
        tiny(**overrides)


def test_moe_routes_each_token_to_its_top_k_experts():
    torch.manual_seed(0)
    moe = MoE(16, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8))
    x = torch.randn(2, 5, 16)
    out = moe(x)
    x_nd = x.reshape(-1, 16)
    logits = moe.router(x_nd)
    top = torch.topk(logits, 2, dim=-1)
    gates = torch.softmax(top.values, dim=-1)

    def expert(e, x_d):
        w1, w3, w2 = moe.experts.w1[e], moe.experts.w3[e], moe.experts.w2[e]
        return (torch.nn.functional.silu(x_d @ w1) * (x_d @ w3)) @ w2

    expected = torch.stack(
        [
            sum(gates[n, j] * expert(int(top.indices[n, j]), x_nd[n]) for j in range(2))
            for n in range(10)
        ]
    )
    assert torch.allclose(out.reshape(-1, 16), expected, atol=1e-5)
    assert moe.routed[-1].counts_x.sum().item() == 20 and moe.routed[-1].dropped == 0


def test_moe_aux_loss_is_minimal_when_balanced_and_bias_steers_load():
    moe = MoE(
        4,
        MoEConfig(
            num_experts=4, top_k=1, expert_ffn_dim=4, aux_loss_coef=1.0, bias_update_rate=0.5
        ),
    )
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(4))
    balanced = torch.eye(4).repeat(3, 1)[None]  # every expert wins three tokens
    moe(balanced)
    assert abs(moe.aux_loss.item() - 1.0) < 0.2  # E * sum(f * p) = 1 at perfect balance
    skewed = torch.tensor([[1.0, 0, 0, 0]]).repeat(8, 1)[None]
    moe(skewed)
    assert moe.routed[-1].counts_x.tolist() == [8, 0, 0, 0] and moe.aux_loss.item() > 1.0
    moe.update_router_bias(moe.routed[-1].counts_x)
    assert moe.selection_bias[0] < 0 < moe.selection_bias[1]


def test_moe_capacity_drops_overflow_in_token_order():
    moe = MoE(4, MoEConfig(num_experts=4, top_k=1, expert_ffn_dim=4, capacity_factor=1.0))
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(4))
    x = torch.tensor([[1.0, 0, 0, 0]]).repeat(8, 1)[None] + 0.01 * torch.randn(1, 8, 4)
    out = moe(x)
    assert moe.routed[-1].dropped == 6  # capacity ceil(1.0 * 8 / 4) = 2 for expert 0
    assert out[0, 2:].abs().sum() == 0 and out[0, :2].abs().sum() > 0


def test_moe_model_reports_aux_loss_and_shared_expert_runs():
    model = Transformer(
        tiny(moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16, shared_expert=True))
    )
    model(torch.randint(0, 97, (2, 8)))
    assert len(model.moe_layers()) == 2
    assert all(layer.aux_loss.item() > 0 for layer in model.moe_layers())
    assert Transformer(tiny()).moe_layers() == []


def test_moe_balancing_loss_joins_backward_weighted_by_its_scale():
    """The balancing loss reaches the router through the layer's own output, as if
    ``aux_scale x aux_loss`` were added to the objective (a pipeline stage's layers have no
    other way to the loss); a recompute in backward is not counted as routing twice."""
    torch.manual_seed(0)
    moe = MoE(8, MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=8, aux_loss_coef=0.5))
    x = torch.randn(2, 5, 8)
    moe.aux_scale = 0.25
    moe(x).sum().backward()
    attached = moe.router.weight.grad.clone()
    moe.router.weight.grad = None
    moe.aux_scale = 0.0
    (moe(x).sum() + 0.25 * moe.aux_loss).backward()
    assert torch.allclose(attached, moe.router.weight.grad, atol=1e-6)
    assert not torch.equal(attached, torch.zeros_like(attached))
    moe.routed.clear()
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert len(moe.routed) == 1
