"""Ring attention (``goodput.train.ring_attention``) against full causal attention on CPU.

Baseline: ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` on the
whole sequence in one process, forward + backward. Shape: batch 1, 8 query heads over 4 kv
heads, head dim 64; sequences of 2,048 and 4,096 tokens; fp32 and bf16.

(a) Decomposition overhead: ``ring_attention`` with cp=1 (no communication; the block kernels,
the log-sum-exp merge and the custom backward) against the baseline in the same process with the
same threads (all cores), for the "fused" kernel (CPU flash, the one SDPA itself runs) and, at
2,048 tokens in fp32 only, the "math" kernel (plain torch ops: it materialises every [t, t]
score block, ~10x slower; at 4,096 tokens it would cost minutes).

(b) Context parallelism on the same cores: ``ring_attention`` with cp=2 on 2 gloo ranks of one
thread each ("fused" kernel) against the baseline on one rank with 2 threads, in the same
spawned pair (rank 1 waits in a barrier while rank 0 runs the baseline). A repeat's ring time
is the slower rank's. Memory per rank: the bytes autograd saves for backward, measured with
``saved_tensors_hooks`` (inputs, output, log-sum-exp), plus the ring's own largest transient
buffers, counted from the shapes (two K/V blocks and three fp32 dK/dV accumulators in flight
and the fp32 dq accumulator): an estimate, not a resident-memory figure.

Target: none to meet on CPU. (a) should be close to 1 for "fused" (the same kernel, with the
rank's own block as one causal call); (b) measures whether splitting the sequence over ranks
costs more than the same cores spent inside one kernel — on two cores of one VM gloo's copies
through loopback are not free, and the win of CP, holding 1/cp of the sequence per rank, is
memory, not speed.

Method: every variant runs once untimed, then ``REPEATS`` repeats of each, the order rotated
every repeat so that drift on this shared machine hits every variant alike; each figure is the
median. Ratio: the median over repeats of (variant time / baseline time) within each repeat,
so < 1 is faster than the baseline. Every variant's output must match the baseline's (to
``FP32_TOLERANCE`` / ``BF16_TOLERANCE``) or the benchmark fails.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from goodput.testing.dist import run_distributed
from goodput.train.ring_attention import ContextLayout, ring_attention

BATCH, HEADS, KV_HEADS, HEAD_DIM = 1, 8, 4, 64
SEQ_LENS = (2048, 4096)
DTYPES = ("float32", "bfloat16")
MATH_CASE = ("float32", 2048)
REPEATS = 5
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # max abs difference of the outputs
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _ring(layout: ContextLayout, group: Any, kernel: str) -> Attention:
    return lambda q, k, v: ring_attention(q, k, v, layout=layout, group=group, kernel=kernel)


def _inputs(dtype: str, seq_len: int) -> list[torch.Tensor]:
    """Full-sequence q, k, v, output gradient: the same on every rank (one seed)."""
    generator = torch.Generator().manual_seed(seq_len)
    heads = (HEADS, KV_HEADS, KV_HEADS, HEADS)
    return [
        torch.randn(BATCH, h, seq_len, HEAD_DIM, generator=generator).to(getattr(torch, dtype))
        for h in heads
    ]


def _split(layout: ContextLayout, x_bhte: torch.Tensor, rank: int) -> torch.Tensor:
    return layout.split(x_bhte.transpose(1, 2), rank).transpose(1, 2).contiguous()


def _forward_backward_s(attention: Attention, tensors: list[torch.Tensor]) -> float:
    q, k, v = (x.detach().requires_grad_() for x in tensors[:3])
    start = time.perf_counter()
    attention(q, k, v).backward(tensors[3])
    return time.perf_counter() - start


def _check(name: str, dtype: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    difference = (got.float() - expected.float()).abs().max().item()
    if difference > TOLERANCE[dtype]:
        raise RuntimeError(f"{name} differs from full attention by {difference:.2e} ({dtype})")


def _saved_mib(attention: Attention, tensors: list[torch.Tensor]) -> float:
    """MiB autograd holds for backward after one forward: each storage counted once."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    q, k, v = (x.detach().requires_grad_() for x in tensors[:3])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        attention(q, k, v)
    return sum(storages.values()) / 2**20


def _ring_buffers_mib(layout: ContextLayout, dtype: str) -> float:
    """The ring's largest transient buffers in backward (see the module docstring)."""
    tokens = max(layout.local_length(rank) for rank in range(layout.cp))
    kv_block = 2 * BATCH * KV_HEADS * tokens * HEAD_DIM
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return (
        2 * kv_block * element + 3 * kv_block * 4 + BATCH * HEADS * tokens * HEAD_DIM * 4
    ) / 2**20


def _rotated(names: list[str], repeat: int) -> list[str]:
    shift = repeat % len(names)
    return names[shift:] + names[:shift]


def _single_process() -> dict[str, Any]:
    """(a): every case's variants side by side in this process, all its threads."""
    figures: dict[str, Any] = {}
    for dtype in DTYPES:
        for seq_len in SEQ_LENS:
            tensors = _inputs(dtype, seq_len)
            layout = ContextLayout(seq_len, 1)
            variants = {"full": _full_attention, "ring_fused": _ring(layout, None, "fused")}
            if (dtype, seq_len) == MATH_CASE:
                variants["ring_math"] = _ring(layout, None, "math")
            expected = _full_attention(*tensors[:3])
            for name, attention in variants.items():
                _check(f"cp=1 {name}", dtype, attention(*tensors[:3]), expected)
                _forward_backward_s(attention, tensors)  # warm-up
            seconds: dict[str, list[float]] = {name: [] for name in variants}
            for repeat in range(REPEATS):
                for name in _rotated(list(variants), repeat):
                    seconds[name].append(_forward_backward_s(variants[name], tensors))
            figures[f"{dtype} t={seq_len}"] = _summary(seconds)
    return figures


def _summary(seconds: dict[str, list[float]]) -> dict[str, Any]:
    full = seconds["full"]
    return {
        "median_s": {name: statistics.median(each) for name, each in seconds.items()},
        "ratio": {
            name: statistics.median(s / f for s, f in zip(each, full, strict=True))
            for name, each in seconds.items()
            if name != "full"
        },
    }


def _two_ranks(rank: int, world_size: int, cases: list[tuple[str, int]]) -> dict[str, Any]:
    """(b) on one rank: per case, (baseline seconds on rank 0, ring seconds on this rank)."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    out: dict[str, Any] = {}
    for dtype, seq_len in cases:
        full_tensors = _inputs(dtype, seq_len)
        layout = ContextLayout(seq_len, world_size)
        local = [_split(layout, x, rank) for x in full_tensors]
        ring = _ring(layout, group, "fused")
        expected = _split(layout, _full_attention(*full_tensors[:3]), rank)
        _check("cp=2 ring_fused", dtype, ring(*local[:3]), expected)
        _forward_backward_s(ring, local)  # warm-up
        full_s, ring_s = [], []
        for repeat in range(REPEATS + 1):  # the first repeat warms the 2-thread baseline up
            for side in ("full", "ring") if repeat % 2 == 0 else ("ring", "full"):
                dist.barrier()
                if side == "ring":
                    ring_s.append(_forward_backward_s(ring, local))
                elif rank == 0:
                    torch.set_num_threads(2)
                    full_s.append(_forward_backward_s(_full_attention, full_tensors))
                    torch.set_num_threads(1)
        out[f"{dtype} t={seq_len}"] = {
            "full_s": full_s[1:],
            "ring_s": ring_s[1:],
            "saved_mib": {
                "full": _saved_mib(_full_attention, full_tensors),
                "ring_per_rank": _saved_mib(ring, local),
            },
            "ring_buffers_mib": _ring_buffers_mib(layout, dtype),
        }
    return out


def _context_parallel() -> dict[str, Any]:
    cases = [(dtype, seq_len) for dtype in DTYPES for seq_len in SEQ_LENS]
    ranks = run_distributed(_two_ranks, 2, cases, timeout_s=600)
    figures: dict[str, Any] = {}
    for dtype, seq_len in cases:
        key = f"{dtype} t={seq_len}"
        full_s = ranks[0][key]["full_s"]
        ring_s = [max(times) for times in zip(*(r[key]["ring_s"] for r in ranks), strict=True)]
        figures[key] = {
            **_summary({"full": full_s, "ring_cp2": ring_s}),
            "saved_mib": ranks[0][key]["saved_mib"],
            "ring_buffers_mib": ranks[0][key]["ring_buffers_mib"],
        }
    return figures


def main() -> dict[str, Any]:
    start = time.perf_counter()
    figures = {
        "shape": f"b={BATCH} h={HEADS} kv_heads={KV_HEADS} e={HEAD_DIM}",
        "threads_cp1": torch.get_num_threads(),
        "cp1": _single_process(),
        "cp2": _context_parallel(),
    }
    figures["seconds"] = time.perf_counter() - start
    _print_summary(figures)
    return figures


def _print_summary(figures: dict[str, Any]) -> None:
    print(
        f"ring: causal attention fwd+bwd, {figures['shape']}; median of {REPEATS} repeats; "
        "ratio = ring time / full SDPA time (< 1 is faster)"
    )
    print(f"  (a) cp=1 vs full SDPA, both {figures['threads_cp1']} threads:")
    for key, case in figures["cp1"].items():
        ratios = "  ".join(f"{name} {ratio:.2f}x" for name, ratio in case["ratio"].items())
        full_ms = 1e3 * case["median_s"]["full"]
        print(f"    {key:<16} full {full_ms:7.1f} ms  {ratios}")
    print("  (b) cp=2 on 2 ranks x 1 thread vs full SDPA on 1 rank x 2 threads:")
    for key, case in figures["cp2"].items():
        saved = case["saved_mib"]
        print(
            f"    {key:<16} full {1e3 * case['median_s']['full']:7.1f} ms  ring "
            f"{1e3 * case['median_s']['ring_cp2']:7.1f} ms  {case['ratio']['ring_cp2']:.2f}x  "
            f"saved for backward {saved['full']:.0f} MiB -> {saved['ring_per_rank']:.0f} MiB "
            f"a rank (+{case['ring_buffers_mib']:.0f} MiB ring buffers)"
        )
    print(f"  {figures['seconds']:.0f} s in all")
