"""Mixture-of-experts dispatch on CPU: goodput's grouped experts, alone and split over 2 ranks
by the all-to-all dispatch, against the dense loop over a list of expert modules (goodput's MoE
before grouped weights, written out below as the baseline) for the same MoE and the same tokens.

The layer: dim 256, 8 SwiGLU experts of ffn 512, top-2, capacity factor 1.25, fp32; 4,096
tokens a step (the whole batch: 2 ranks take 2,048 each). What is timed: one forward and
backward of the layer (routing, capacity, dispatch, experts, combine), median of ``REPEATS``
timed iterations after ``WARMUP`` untimed ones (the loop and the grouped layer take turns).

Rows, all against the dense loop on one process with both cores (2 intra-op threads):
- ``grouped, 1 rank``: ``model.MoE`` with every expert at home (2 threads): the grouped
  weights and the vectorised routing against the loop;
- ``all-to-all, ep=2``: the same MoE split by ``[parallel] ep = 2`` over 2 gloo ranks of one
  thread each (the same 2 cores), each rank routing half the tokens and computing 4 experts; an
  iteration's time is its slowest rank's.
The ratio is baseline time / ours (> 1: faster). Target: none to meet on CPU (the experts'
matmuls dominate both; the dispatch's two all-to-alls are overhead that a GPU's fabric hides
better than gloo over loopback); it shows the dispatch is not gratuitously slow and that the
loop's per-expert Python work is gone.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from goodput.testing.dist import run_distributed
from goodput.train.config.model import MoEConfig
from goodput.train.experts import distribute_experts
from goodput.train.model import MoE

DIM = 256
CONFIG = MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=512, capacity_factor=1.25)
TOKENS = 4096
WARMUP = 3
REPEATS = 15
EP = 2


class LoopMoE(nn.Module):
    """The baseline: the same routing and capacity, each expert its own three ``nn.Linear``s
    in a ``ModuleList``, a Python loop over them (what goodput's MoE was before this)."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.cfg, self.router = moe.cfg, moe.router
        self.experts = nn.ModuleList()
        for e in range(self.cfg.num_experts):
            expert = nn.ModuleDict()
            for name in ("w1", "w3", "w2"):
                grouped = getattr(moe.experts, name)[e]  # [in, out]; nn.Linear holds [out, in]
                linear = nn.Linear(*grouped.shape, bias=False)
                with torch.no_grad():
                    linear.weight.copy_(grouped.t())
                expert[name] = linear
            self.experts.append(expert)

    def forward(self, x_nd: torch.Tensor) -> torch.Tensor:
        logits = self.router(x_nd).float()
        chosen = torch.topk(logits, self.cfg.top_k, dim=-1).indices
        gates = torch.softmax(logits.gather(1, chosen), dim=-1).type_as(x_nd)
        assert self.cfg.capacity_factor is not None
        capacity = math.ceil(self.cfg.capacity_factor * chosen.numel() / self.cfg.num_experts)
        out = torch.zeros_like(x_nd)
        for expert_id, expert in enumerate(self.experts):
            token, slot = torch.nonzero(chosen == expert_id, as_tuple=True)
            token, slot = token[:capacity], slot[:capacity]
            if len(token):
                rows = x_nd[token]
                hidden = F.silu(expert["w1"](rows)) * expert["w3"](rows)
                out.index_add_(0, token, expert["w2"](hidden) * gates[token, slot, None])
        return out


def _moe() -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, CONFIG)
    for weight in (moe.experts.w1, moe.experts.w3, moe.experts.w2):
        nn.init.normal_(weight, std=0.02)
    return moe


def _tokens(rank: int, num_ranks: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randn(TOKENS, DIM, generator=generator)
    share = TOKENS // num_ranks
    return tokens[rank * share : (rank + 1) * share]


def _time(layers: list[tuple[nn.Module, torch.Tensor]], barrier: Any = None) -> list[list[float]]:
    """Per layer, the seconds of each timed forward and backward; the layers take turns, so
    a neighbour's burst on this shared machine hits each alike."""
    times: list[list[float]] = [[] for _ in layers]
    for iteration in range(WARMUP + REPEATS):
        for layer_times, (layer, x) in zip(times, layers, strict=True):
            if barrier is not None:
                barrier()
            start = time.perf_counter()
            layer(x).sum().backward()
            if iteration >= WARMUP:
                layer_times.append(time.perf_counter() - start)
    return times


def _dispatch_rank(rank: int, world_size: int) -> list[float]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    moe = _moe()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    distribute_experts(moe, mesh["ep"])
    x_bd = _tokens(rank, world_size)[None]
    return _time([(moe, x_bd)], barrier=dist.barrier)[0]


def main() -> dict[str, Any]:
    torch.set_num_threads(EP)
    moe = _moe()
    loop = LoopMoE(moe)
    x_nd = _tokens(0, 1)
    with torch.no_grad():  # the two compute the same layer
        difference = (loop(x_nd) - moe(x_nd[None])[0]).abs().max().item()
    if difference > 1e-4:
        raise RuntimeError(f"the loop baseline and goodput's MoE differ by {difference}")
    loop_s, grouped_s = _time([(loop, x_nd), (moe, x_nd[None])])
    per_rank = run_distributed(_dispatch_rank, EP, timeout_s=300)
    dispatch_s = [max(times) for times in zip(*per_rank, strict=True)]
    baseline = statistics.median(loop_s)
    figures = {
        "tokens": TOKENS,
        "dense_loop_s": baseline,
        "grouped_s": statistics.median(grouped_s),
        "all_to_all_ep2_s": statistics.median(dispatch_s),
        "max_output_difference": difference,
    }
    figures["ratio_grouped"] = baseline / figures["grouped_s"]
    figures["ratio_all_to_all_ep2"] = baseline / figures["all_to_all_ep2_s"]
    print(
        f"moe: dim {DIM}, {CONFIG.num_experts} experts of ffn {CONFIG.expert_ffn_dim}, top-"
        f"{CONFIG.top_k}, {TOKENS} tokens, forward+backward, median of {REPEATS}"
    )
    print(f"  dense loop, 1 process x 2 threads (baseline): {1e3 * baseline:7.1f} ms")
    print(
        f"  grouped experts, 1 process x 2 threads     : {1e3 * figures['grouped_s']:7.1f} ms  "
        f"{figures['ratio_grouped']:.2f}x"
    )
    print(
        f"  all-to-all dispatch, ep=2 x 1 thread       : {1e3 * figures['all_to_all_ep2_s']:7.1f} "
        f"ms  {figures['ratio_all_to_all_ep2']:.2f}x"
    )
    return figures
