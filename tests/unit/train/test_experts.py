"""Grouped experts and expert parallelism: the grouped matmul (fused or per group: the same
numbers), the routing rules against a direct transcription of them (top-k, first-come
capacity in token order, gates, the shared expert), and the all-to-all dispatch on 2 and 4 real
gloo ranks against every expert computed in one place, forward and backward."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from goodput.testing.dist import run_distributed
from goodput.train.config.model import MoEConfig
from goodput.train.experts import (
    _expert_major_order,
    _fused_grouped_mm_takes,
    distribute_experts,
    grouped_matmul,
)
from goodput.train.model import MoE


def per_group(x, w, counts):
    return torch.cat([rows @ w[i] for i, rows in enumerate(x.split(counts))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_grouped_matmul_gives_the_per_group_numbers(dtype):
    torch.manual_seed(0)
    x = torch.randn(13, 16, dtype=dtype)
    w = torch.randn(4, 16, 32, dtype=dtype)
    counts = [3, 0, 6, 4]  # an expert that got no tokens, too
    assert _fused_grouped_mm_takes(x, w)
    fused, looped = grouped_matmul(x, w, counts), per_group(x, w, counts)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(fused.float(), looped.float(), rtol=tolerance, atol=tolerance)


def test_widths_the_fused_kernel_cannot_take_go_group_by_group():
    x, w = torch.randn(5, 6), torch.randn(2, 6, 10)  # 24-byte rows: not 16-byte aligned
    assert not _fused_grouped_mm_takes(x, w)
    assert torch.equal(grouped_matmul(x, w, [2, 3]), per_group(x, w, [2, 3]))
    assert grouped_matmul(x[:0], w, [0, 0]).shape == (0, 10)


def test_rows_from_each_source_are_regrouped_by_expert():
    # 2 sources x 2 local experts: source 0 sends 2 rows for expert 0 and 1 for expert 1,
    # source 1 sends 1 and 3. Source-major rows: [s0e0 s0e0 s0e1 s1e0 s1e1 s1e1 s1e1].
    counts = torch.tensor([[2, 1], [1, 3]])
    assert _expert_major_order(counts).tolist() == [0, 1, 3, 2, 4, 5, 6]
    assert _expert_major_order(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


def transcribed_moe(moe, x_btd):
    """The routing rules written out token by token: top-k of the biased logits, softmax gates
    over the k chosen raw logits, each expert keeping its first ``capacity`` assignments in
    (token, slot) order, dropped assignments adding nothing."""
    cfg = moe.cfg
    x_nd = x_btd.reshape(-1, x_btd.shape[-1])
    logits = moe.router(x_nd).float()
    chosen = torch.topk(logits + moe.selection_bias, cfg.top_k, dim=-1).indices
    gates = torch.softmax(logits.gather(1, chosen), dim=-1)
    capacity = (
        math.ceil(cfg.capacity_factor * chosen.numel() / cfg.num_experts)
        if cfg.capacity_factor
        else chosen.numel()
    )
    taken = [0] * cfg.num_experts
    rows = []
    for n in range(len(x_nd)):
        total = torch.zeros_like(x_nd[n])
        for slot in range(cfg.top_k):
            e = int(chosen[n, slot])
            if taken[e] < capacity:
                taken[e] += 1
                w1, w3, w2 = moe.experts.w1[e], moe.experts.w3[e], moe.experts.w2[e]
                total = total + gates[n, slot] * ((F.silu(x_nd[n] @ w1) * (x_nd[n] @ w3)) @ w2)
        rows.append(total)
    out = torch.stack(rows)
    if moe.shared is not None:
        out = out + moe.shared(x_nd)
    dropped = sum(max(int((chosen == e).sum()) - capacity, 0) for e in range(cfg.num_experts))
    return out.view_as(x_btd), dropped


@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.5])
def test_moe_follows_its_routing_rules_forward_and_backward(capacity_factor):
    torch.manual_seed(0)
    cfg = MoEConfig(
        num_experts=4,
        top_k=2,
        expert_ffn_dim=8,
        shared_expert=True,
        capacity_factor=capacity_factor,
    )
    moe = MoE(16, cfg)
    for weight in (moe.experts.w1, moe.experts.w3, moe.experts.w2):
        torch.nn.init.normal_(weight, std=0.3)
    with torch.no_grad():
        moe.selection_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.1]))
    x = torch.randn(2, 7, 16)
    out = moe(x)
    expected, dropped = transcribed_moe(moe, x)
    assert torch.allclose(out, expected, atol=1e-5)
    assert int(moe.routed[-1].dropped) == dropped
    assert (dropped > 0) == (capacity_factor is not None)  # 14 tokens never split evenly
    grad = torch.randn_like(out)
    weights = [moe.experts.w1, moe.experts.w3, moe.experts.w2, moe.router.weight]
    got = torch.autograd.grad(out, weights, grad)
    want = torch.autograd.grad(expected, weights, grad)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


MOE = MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=8, capacity_factor=1.5)


def dispatch_rank(rank, world_size, ep):
    """Each rank routes its own tokens through a MoE whose experts ``ep`` ranks split, and
    through the same MoE with every expert at home; both outputs, and the experts' gradients
    (the whole-MoE ones summed over ranks, as the split experts receive every rank's share)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    whole = MoE(16, MOE)
    for weight in (whole.experts.w1, whole.experts.w3, whole.experts.w2):
        torch.nn.init.normal_(weight, std=0.3)
    torch.manual_seed(0)
    split = MoE(16, MOE)
    split.load_state_dict(whole.state_dict())
    mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("other", "ep"))
    distribute_experts(split, mesh["ep"])
    torch.manual_seed(100 + rank)  # each rank its own tokens
    x = torch.randn(3, 5, 16)
    grad = torch.randn(3, 5, 16)
    out_whole, out_split = whole(x), split(x)
    out_whole.backward(grad)
    out_split.backward(grad)
    whole_grads = [w.grad.clone() for w in (whole.experts.w1, whole.experts.w3, whole.experts.w2)]
    group = mesh["ep"].get_group()
    for whole_grad in whole_grads:  # the ep group's tokens all reach the split experts
        dist.all_reduce(whole_grad, group=group)
    ep_rank = mesh["ep"].get_local_rank()
    local = MOE.num_experts // ep
    mine = slice(ep_rank * local, (ep_rank + 1) * local)
    split_grads = [
        w.grad.to_local() for w in (split.experts.w1, split.experts.w3, split.experts.w2)
    ]
    return (
        (out_whole - out_split).abs().max().item(),
        max(
            (g[mine] - s).abs().max().item() for g, s in zip(whole_grads, split_grads, strict=True)
        ),
        int(split.routed[-1].dropped),
        int(whole.routed[-1].dropped),
    )


@pytest.mark.parametrize(("world_size", "ep"), [(2, 2), (4, 4), (4, 2)])
def test_split_experts_compute_what_experts_at_home_do(world_size, ep):
    for out_difference, grad_difference, dropped_split, dropped_whole in run_distributed(
        dispatch_rank, world_size, ep, timeout_s=120
    ):
        assert out_difference < 1e-5
        assert grad_difference < 1e-5
        assert dropped_split == dropped_whole
