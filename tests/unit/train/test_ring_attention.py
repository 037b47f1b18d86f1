"""Ring attention equals full causal attention, forward and backward, on real gloo rings.

Reference: autograd through full-sequence ``F.scaled_dot_product_attention(is_causal=True,
enable_gqa=True)`` in fp32 on the same inputs. Each rank of a ring computes ``ring_attention``
on its ``ContextLayout.split`` of the inputs and backpropagates its split of one full-sequence
output gradient; the parent puts every rank's out, dq, dk and dv back in sequence order by
``layout.positions`` and compares them with the reference. Cases: cp = 1 (in process), 2 and 4
(spawned gloo ranks, one spawn per size for all its cases); GQA (4 query heads over 2 kv heads)
and plain multi-head; a sequence length that 2cp divides and ones it does not (29 with cp=2,
23 and 37 with cp=4: uneven chunks and uneven ranks); both block kernels.

The same spawns also check what needs a live group: the number of messages a rank sends (cp-1
forward, K and V packed in one buffer a hop; 2cp-1 backward, the accumulators' extra hop), that
a group of one rank is plain local attention, and that a layout for another cp is refused.

Tolerance, fp32: 1e-5 absolute and relative. Measured over all cases: within 1.7e-6 (math
kernel) and 1.9e-6 (fused, CPU flash) of the reference, the ring summing its blocks in another
order than one kernel does. The bugs this guards against are off by O(0.1-1), ~1e4 times the
tolerance; tried and caught: a non-causal diagonal block, a later chunk not skipped, D taken
from the wrong output, the accumulators' extra hop left out.

Tolerance, bf16 (inputs rounded to bf16; the reference runs fp32 on the same rounded values):
4e-2 absolute plus 1e-2 relative. Measured: within 2.1e-2 (fused) and 9.1e-3 (math): the
kernels round their partial outputs and gradients to bf16 (the merge is fp32), as bf16 SDPA
does (bf16 SDPA itself against the same reference: 1.8e-2).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import goodput.train.ring_attention as ring_module
from goodput.testing.dist import run_distributed
from goodput.train.ring_attention import ContextLayout, block_pairs, ring_attention

pytestmark = pytest.mark.timeout(300)

BATCH, HEAD_DIM = 2, 16
FP32_TOLERANCE = (1e-5, 1e-5)  # (absolute, relative)
BF16_TOLERANCE = (4e-2, 1e-2)

# (seq_len, query heads, kv heads, kernel, dtype)
Case = tuple[int, int, int, str, str]
CASES: dict[int, list[Case]] = {
    cp: [
        (seq_len, heads, kv_heads, kernel, "float32")
        for seq_len in seq_lens
        for heads, kv_heads in ((4, 2), (2, 2))
        for kernel in ("math", "fused")
    ]
    for cp, seq_lens in {1: (17, 32), 2: (29, 32), 4: (23, 37, 40)}.items()
}
CASES[2] += [(29, 4, 2, "fused", "bfloat16"), (29, 4, 2, "math", "bfloat16")]


def case_inputs(case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v and output gradient, the same on every rank."""
    seq_len, heads, kv_heads, _, dtype_name = case
    generator = torch.Generator().manual_seed(seed)
    shapes = [(heads, seq_len), (kv_heads, seq_len), (kv_heads, seq_len), (heads, seq_len)]
    return tuple(
        torch.randn(BATCH, h, t, HEAD_DIM, generator=generator).to(getattr(torch, dtype_name))
        for h, t in shapes
    )


def reference(case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    """out, dq, dk, dv of full causal SDPA in fp32."""
    q, k, v, dout = (x.float() for x in case_inputs(case, seed))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def split_heads_first(layout: ContextLayout, x_bhte: torch.Tensor, rank: int) -> torch.Tensor:
    """``layout.split`` works on [b, t, ...]: the model's layout before heads move ahead of t."""
    return layout.split(x_bhte.transpose(1, 2), rank).transpose(1, 2)


def ring_case(case: Case, seed: int, cp: int, rank: int, group: Any) -> tuple[torch.Tensor, ...]:
    """This rank's out, dq, dk, dv (fp32) for its split of the case's inputs."""
    seq_len, _, _, kernel, _ = case
    layout = ContextLayout(seq_len, cp)
    q, k, v, dout = (split_heads_first(layout, x, rank) for x in case_inputs(case, seed))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = ring_attention(q, k, v, layout=layout, group=group, kernel=kernel)
    assert out.dtype == q.dtype and out.shape == q.shape
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return tuple(x.detach().float() for x in (out, *grads))


def assemble(layout: ContextLayout, per_rank: list[tuple[torch.Tensor, ...]]) -> list[Any]:
    """Every rank's tensors put back in sequence order; a position no rank holds stays NaN and
    fails any comparison."""
    full = []
    for index in range(4):
        pieces = [results[index] for results in per_rank]
        whole = torch.full((*pieces[0].shape[:2], layout.seq_len, HEAD_DIM), float("nan"))
        for rank, piece in enumerate(pieces):
            whole.index_copy_(2, layout.positions(rank), piece)
        full.append(whole)
    return full


def check_case(case: Case, seed: int, per_rank: list[tuple[torch.Tensor, ...]]) -> None:
    layout = ContextLayout(case[0], len(per_rank))
    atol, rtol = BF16_TOLERANCE if case[4] == "bfloat16" else FP32_TOLERANCE
    for name, got, expected in zip(
        ("out", "dq", "dk", "dv"), assemble(layout, per_rank), reference(case, seed), strict=True
    ):
        try:
            torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
        except AssertionError as error:
            raise AssertionError(f"{case} {name}: {error}") from None


def _counting_sends(counter: list[int]):
    real_batch = dist.batch_isend_irecv

    def batch_isend_irecv(ops: list[dist.P2POp]) -> Any:
        counter[0] += sum(op.op is dist.isend for op in ops)
        return real_batch(ops)

    return batch_isend_irecv


def _ring_ranks(rank: int, world_size: int, cases: list[Case]) -> dict[str, Any]:
    """One rank: every case on the whole group, then the checks that need a live group."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    results = [ring_case(case, seed, world_size, rank, group) for seed, case in enumerate(cases)]
    # Messages a rank sends: forward cp-1 (K and V in one buffer a hop), backward cp-1 K/V
    # hops plus cp accumulator hops.
    sends, layout = [0], ContextLayout(4 * world_size, world_size)
    q, k, v = (
        split_heads_first(layout, torch.randn(1, 2, 4 * world_size, 8), rank) for _ in range(3)
    )
    q.requires_grad_()
    real_batch, ring_module.dist.batch_isend_irecv = dist.batch_isend_irecv, _counting_sends(sends)
    try:
        out = ring_attention(q, k, v, layout=layout, group=group)
        forward_sends = sends[0]
        out.sum().backward()
    finally:
        ring_module.dist.batch_isend_irecv = real_batch
    # A group of one is plain local attention, whatever the world around it.
    singles = [dist.new_group([r]) for r in range(world_size)]
    own = singles[rank]
    single_case: Case = (11, 4, 2, "fused", "float32")
    single = ring_case(single_case, 99, 1, 0, own)
    try:
        ring_attention(q, k, v, layout=ContextLayout(64, 2 * world_size), group=group)
        mismatch = ""
    except ValueError as error:
        mismatch = str(error)
    return {
        "results": results,
        "sends": (forward_sends, sends[0] - forward_sends),
        "single": single,
        "mismatch": mismatch,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_matches_full_attention(world_size: int) -> None:
    cases = CASES[world_size]
    ranks = run_distributed(_ring_ranks, world_size, cases, timeout_s=240)
    for seed, case in enumerate(cases):
        check_case(case, seed, [r["results"][seed] for r in ranks])
    for r in ranks:
        assert r["sends"] == (world_size - 1, 2 * world_size - 1)
        check_case((11, 4, 2, "fused", "float32"), 99, [r["single"]])
        assert f"layout.cp={2 * world_size}" in r["mismatch"]
        assert f"group has {world_size}" in r["mismatch"]


@pytest.mark.parametrize("case", CASES[1], ids=str)
def test_cp1_is_local_causal_attention(case: Case) -> None:
    check_case(case, 7, [ring_case(case, 7, 1, 0, None)])


def test_bf16_cp1_stays_bf16_within_tolerance() -> None:
    case: Case = (17, 4, 2, "fused", "bfloat16")
    check_case(case, 3, [ring_case(case, 3, 1, 0, None)])


def test_layout_chunks_cover_the_sequence_once_near_evenly() -> None:
    for seq_len, cp in [(8, 1), (2, 1), (29, 2), (32, 2), (23, 4), (8, 4), (1001, 8)]:
        layout = ContextLayout(seq_len, cp)
        bounds = layout.chunk_bounds()
        assert len(bounds) == 2 * cp
        assert bounds[0][0] == 0 and bounds[-1][1] == seq_len
        assert all(end == start for (_, end), (start, _) in pairwise(bounds))
        sizes = [end - start for start, end in bounds]
        expected = [len(c) for c in torch.tensor_split(torch.arange(seq_len), 2 * cp)]
        assert sizes == expected
        everywhere = torch.cat([layout.positions(rank) for rank in range(cp)])
        assert torch.equal(everywhere.sort().values, torch.arange(seq_len))
        assert sum(layout.local_length(rank) for rank in range(cp)) == seq_len


def test_layout_rank_holds_mirrored_chunks_in_order() -> None:
    layout = ContextLayout(23, 4)  # chunk sizes 3 3 3 3 3 3 3 2
    assert [layout.rank_chunks(rank) for rank in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert layout.positions(0).tolist() == [0, 1, 2, 21, 22]
    assert layout.positions(3).tolist() == [9, 10, 11, 12, 13, 14]
    assert layout.positions(0).dtype == torch.int64
    assert [layout.local_length(rank) for rank in range(4)] == [5, 6, 6, 6]
    tokens_bt = torch.arange(2 * 23).view(2, 23)
    assert layout.split(tokens_bt, 0).tolist() == [[0, 1, 2, 21, 22], [23, 24, 25, 44, 45]]
    x_btd = torch.randn(2, 23, 3)
    assert torch.equal(layout.split(x_btd, 2), x_btd[:, layout.positions(2)])
    with pytest.raises(ValueError, match="rank 4"):
        layout.rank_chunks(4)


def test_layout_rejects_a_sequence_shorter_than_its_chunks() -> None:
    ContextLayout(8, 4)
    with pytest.raises(ValueError, match=r"seq_len=7 .* cp=4"):
        ContextLayout(7, 4)
    with pytest.raises(ValueError, match="cp=0"):
        ContextLayout(8, 0)


def test_blocks_are_chosen_by_chunk_index() -> None:
    layout = ContextLayout(16, 4)  # 8 chunks of 2; rank r holds chunks r and 7-r
    # (q_start, q_end, kv_start, kv_end, causal) in local rows of the queries and of the block
    # own block: both diagonals causal, and chunk 6 sees chunk 1 in full
    assert sorted(block_pairs(layout, 1, 1)) == [
        (0, 2, 0, 2, True),
        (2, 4, 0, 2, False),
        (2, 4, 2, 4, True),
    ]
    # an earlier rank's block: both query chunks see its first chunk only, in one call
    assert block_pairs(layout, 2, 0) == [(0, 4, 0, 2, False)]
    # a later rank's block: only the late query chunk sees it, all of it
    assert block_pairs(layout, 0, 3) == [(2, 4, 0, 4, False)]
    # the last rank's chunks are adjacent: its own block is one causal square
    assert block_pairs(layout, 3, 3) == [(0, 4, 0, 4, True)]
    # uneven chunks (3 3 3 3 3 3 3 2): rank 0 holds 0 and 7 (5 tokens), rank 1 holds 1 and 6
    assert block_pairs(ContextLayout(23, 4), 0, 1) == [(3, 5, 0, 6, False)]
    assert block_pairs(ContextLayout(23, 4), 1, 0) == [(0, 6, 0, 3, False)]


def test_argument_errors() -> None:
    layout = ContextLayout(8, 1)
    q, k = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8)
    with pytest.raises(ValueError, match="auto, math, fused"):
        ring_attention(q, k, k, layout=layout, group=None, kernel="flash")
    with pytest.raises(ValueError, match="8 tokens"):
        ring_attention(q[:, :, :7], k[:, :, :7], k[:, :, :7], layout=layout, group=None)
    with pytest.raises(ValueError, match="multiple"):
        ring_attention(q[:, :3], k, k, layout=layout, group=None)
    with pytest.raises(ValueError, match="group has 1"):
        ring_attention(q, k, k, layout=ContextLayout(8, 2), group=None)
    with pytest.raises(ValueError, match="no fused"):
        ring_attention(
            q.double(), k.double(), k.double(), layout=layout, group=None, kernel="fused"
        )
