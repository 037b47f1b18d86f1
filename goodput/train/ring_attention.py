"""Context-parallel causal attention: a ring over the CP group, in plain torch ops and P2P.

Owns ``ContextLayout`` (which tokens of a sequence each CP rank holds) and ``ring_attention``
(causal attention of this rank's queries over the whole sequence's keys, differentiable). torch's
own context-parallel API has no DTensor sharding strategy for CPU attention (torch 2.13), so this
is our own ``autograd.Function`` over any process group, gloo included.

Invariants:
- The layout is causally load balanced: the sequence is cut into 2cp near-even chunks
  (``torch.tensor_split`` sizes) and rank r holds chunks r and 2cp-1-r, in that order, so every
  rank has about the same number of visible (query, key) pairs. Every chunk holds >= 1 token, so
  every query row sees at least itself and no softmax row is empty.
- The result equals the rows of full causal ``F.scaled_dot_product_attention`` (GQA: query head
  i reads kv head i // (h // k)) on the whole sequence, up to summation order.
- Forward: the K/V block (K and V packed in one buffer) moves one rank on per hop, cp-1 hops;
  the next hop is posted before the current block is computed, so the transfer overlaps compute.
  Which (query chunk, kv chunk) pairs are computed is decided by chunk index: lower is fully
  visible, equal is the causal diagonal, higher is skipped. Partial results are merged by
  log-sum-exp in fp32. With cp=1 the rank's tokens are the sequence in order: one causal block,
  the kernel's own output, no merge.
- Backward: K/V rotate again; each block's dK/dV accumulator (fp32) follows its block one hop
  behind and takes one extra hop home, so each rank ends with the gradient of its own K/V. Every
  block's backward uses the merged (global) out and lse.
- Block kernels: "math" (plain torch ops, fp32, any device) and "fused" (the device's own SDPA
  kernel that returns the log-sum-exp: CPU flash for fp32/bf16/fp16, CUDA flash for fp16/bf16);
  "auto" takes fused where the device has it, else math; "fused" where there is none is an error.

Does not: rotary embedding, dropout, masks other than causal, document masking, or any sharding
of the batch or heads; the caller splits its tokens with ``ContextLayout.split``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from goodput.train.config.parallel import context_chunk_bounds

KERNELS = ("auto", "math", "fused")
# Distinct tags: a K/V block and a dK/dV accumulator can be in flight between the same two
# ranks at once, and gloo matches messages by (peer, tag).
_KV_TAG, _GRAD_TAG = 0, 1


@dataclass(frozen=True, slots=True)
class ContextLayout:
    """How a sequence of seq_len tokens is split over cp ranks, causally load balanced:
    2*cp contiguous chunks (near-even: torch.tensor_split semantics, the first seq_len % (2cp)
    chunks one token longer); rank r holds chunk r and chunk 2cp-1-r, in that order."""

    seq_len: int
    cp: int

    def __post_init__(self) -> None:
        if self.cp < 1:
            raise ValueError(f"context parallel size must be >= 1, got cp={self.cp}")
        if self.seq_len < 2 * self.cp:
            raise ValueError(
                f"seq_len={self.seq_len} is too short for cp={self.cp}: the layout cuts it into "
                f"2*cp={2 * self.cp} chunks of at least one token, so seq_len must be >= 2*cp"
            )

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """[start, end) of each of the 2cp chunks, in sequence order."""
        return context_chunk_bounds(self.seq_len, self.cp)

    def rank_chunks(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.cp:
            raise ValueError(f"rank {rank} is outside the context parallel group of {self.cp}")
        return rank, 2 * self.cp - 1 - rank

    def positions(self, rank: int) -> Tensor:
        """int64 global positions of rank's tokens, in its order."""
        bounds = self.chunk_bounds()
        return torch.cat([torch.arange(*bounds[chunk]) for chunk in self.rank_chunks(rank)])

    def local_length(self, rank: int) -> int:
        return self.local_chunks(rank)[1][2]

    def split(self, tensor_bt: Tensor, rank: int) -> Tensor:
        """rank's tokens of a full-sequence tensor, along dim 1."""
        return tensor_bt.index_select(1, self.positions(rank).to(tensor_bt.device))

    def local_chunks(self, rank: int) -> list[tuple[int, int, int]]:
        """(chunk index, local start, local end) of rank's two chunks in its own tensors."""
        bounds, spans, start = self.chunk_bounds(), [], 0
        for chunk in self.rank_chunks(rank):
            end = start + bounds[chunk][1] - bounds[chunk][0]
            spans.append((chunk, start, end))
            start = end
        return spans


# --- block kernels: attention of one query block over one kv block, with its log-sum-exp ---


class BlockKernel(Protocol):
    """q [b,h,tq,e] over k, v [b,k,tk,e]; causal is the square (tq == tk), top-left mask."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """(out [b,h,tq,e] in q's dtype or fp32, lse fp32 [b,h,tq])."""
        ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """(dq, dk, dv) given the *merged* out and lse, so that P is this block's share of the
        global softmax."""
        ...


def _expand_kv_heads(x_bkte: Tensor, num_heads: int) -> Tensor:
    return x_bkte.repeat_interleave(num_heads // x_bkte.shape[1], dim=1)


def _fold_kv_heads(grad_bhte: Tensor, num_kv_heads: int) -> Tensor:
    """Sum the gradients of the query heads that share a kv head (the inverse of the expand)."""
    b, h, t, e = grad_bhte.shape
    return grad_bhte.view(b, num_kv_heads, h // num_kv_heads, t, e).sum(2)


class MathKernel:
    """Plain torch ops in fp32 on any device; materialises the [tq, tk] score block."""

    @staticmethod
    def _scores(q_bhte: Tensor, k_bhte: Tensor, causal: bool, scale: float) -> Tensor:
        scores_bhtt = (q_bhte @ k_bhte.transpose(-1, -2)) * scale
        if causal:
            above = torch.ones(scores_bhtt.shape[-2:], dtype=torch.bool, device=q_bhte.device)
            scores_bhtt = scores_bhtt.masked_fill(above.triu(1), float("-inf"))
        return scores_bhtt

    def forward(self, q, k, v, causal, scale):
        k_bhte = _expand_kv_heads(k, q.shape[1]).float()
        scores_bhtt = self._scores(q.float(), k_bhte, causal, scale)
        lse_bht = scores_bhtt.logsumexp(-1)
        probs_bhtt = torch.exp(scores_bhtt - lse_bht[..., None])
        return probs_bhtt @ _expand_kv_heads(v, q.shape[1]).float(), lse_bht

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        q_bhte, dout_bhte = q.float(), dout.float()
        k_bhte = _expand_kv_heads(k, q.shape[1]).float()
        v_bhte = _expand_kv_heads(v, q.shape[1]).float()
        probs_bhtt = torch.exp(self._scores(q_bhte, k_bhte, causal, scale) - lse[..., None])
        grad_v = probs_bhtt.transpose(-1, -2) @ dout_bhte
        # D = rowsum(dO * O) with the merged O: the softmax Jacobian of the whole row, not
        # just of this block's share of it.
        delta_bht1 = (dout_bhte * out.float()).sum(-1, keepdim=True)
        grad_scores = probs_bhtt * (dout_bhte @ v_bhte.transpose(-1, -2) - delta_bht1)
        grad_q = (grad_scores @ k_bhte) * scale
        grad_k = (grad_scores.transpose(-1, -2) @ q_bhte) * scale
        return grad_q, _fold_kv_heads(grad_k, k.shape[1]), _fold_kv_heads(grad_v, k.shape[1])


class FusedKernel:
    """The device's own SDPA kernel that returns the log-sum-exp: CPU flash (what SDPA itself
    runs on CPU) or CUDA flash (fp16/bf16, sm80+; not yet run on a GPU here). kv heads are
    expanded to the query heads: the CPU ops take them equal."""

    def __init__(self, device_type: str):
        self.on_cuda = device_type == "cuda"

    def forward(self, q, k, v, causal, scale):
        k, v = _expand_kv_heads(k, q.shape[1]), _expand_kv_heads(v, q.shape[1])
        if self.on_cuda:
            op = torch.ops.aten._scaled_dot_product_flash_attention
            return op(q, k, v, 0.0, causal, scale=scale)[:2]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        num_kv_heads = k.shape[1]
        k, v = _expand_kv_heads(k, q.shape[1]), _expand_kv_heads(v, q.shape[1])
        if self.on_cuda:
            op = torch.ops.aten._scaled_dot_product_flash_attention_backward
            # No packed (varlen) batch: no cumulative lengths; no dropout: no RNG state used.
            rng = torch.empty((), dtype=torch.int64, device=q.device)
            dense = (dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous())
            grads = op(
                *dense, None, None, q.shape[2], k.shape[2], 0.0, causal, rng, rng, scale=scale
            )
        else:
            op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
            grads = op(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        grad_q, grad_k, grad_v = grads
        return grad_q, _fold_kv_heads(grad_k, num_kv_heads), _fold_kv_heads(grad_v, num_kv_heads)


def fused_kernel_for(q: Tensor) -> BlockKernel | None:
    """The device's own fused kernel for q's device, dtype and head dim, or None."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return FusedKernel("cpu")
    if (
        q.device.type == "cuda"
        and torch.version.hip is None
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and torch.backends.cuda.flash_sdp_enabled()
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
    ):
        return FusedKernel("cuda")
    return None


def resolve_kernel(name: str, q: Tensor) -> BlockKernel:
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose from {', '.join(KERNELS)}")
    fused = None if name == "math" else fused_kernel_for(q)
    if name == "fused" and fused is None:
        raise ValueError(
            f"no fused attention kernel for {q.dtype} on {q.device.type} "
            f"(head dim {q.shape[-1]}); use kernel='auto' or 'math'"
        )
    return fused or MathKernel()


# --- the ring ---


class BlockPair(NamedTuple):
    """One kernel call: local query rows [q_start, q_end) over block rows [kv_start, kv_end)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int
    causal: bool


def block_pairs(layout: ContextLayout, q_rank: int, kv_rank: int) -> list[BlockPair]:
    """The kernel calls for q_rank's queries over kv_rank's block: per (query chunk, kv chunk)
    by chunk index, then coalesced where the visible region is one rectangle (fewer calls)."""
    q_chunks, kv_chunks = layout.local_chunks(q_rank), layout.local_chunks(kv_rank)
    if q_rank == kv_rank and q_chunks[1][0] == q_chunks[0][0] + 1:
        # Adjacent chunks (rank cp-1, and cp=1): the rank's tokens are one run of the sequence
        # in order, so its own block is a single causal square.
        return [BlockPair(0, q_chunks[1][2], 0, q_chunks[1][2], causal=True)]
    diagonal, full = [], []
    for q_chunk, q_start, q_end in q_chunks:
        seen = [(start, end) for chunk, start, end in kv_chunks if chunk < q_chunk]
        if seen:  # a prefix of the block (its chunks ascend): one span
            full.append(BlockPair(q_start, q_end, seen[0][0], seen[-1][1], causal=False))
        diagonal += [
            BlockPair(q_start, q_end, start, end, causal=True)
            for chunk, start, end in kv_chunks
            if chunk == q_chunk
        ]
    if len(full) == 2 and full[0][2:] == full[1][2:]:  # both query chunks see the same kv
        full = [full[0]._replace(q_end=full[1].q_end)]
    return diagonal + full


class _Ring:
    """This rank's place in the CP group and its P2P exchange with the neighbours."""

    def __init__(self, layout: ContextLayout, group: dist.ProcessGroup | None):
        self.size = 1 if group is None else dist.get_world_size(group)
        if layout.cp != self.size:
            raise ValueError(
                f"layout.cp={layout.cp} but the context parallel group has {self.size}"
            )
        self.layout, self.group = layout, group
        self.rank = 0 if group is None else dist.get_rank(group)
        if group is not None and self.size > 1:
            self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev_peer = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def source(self, step: int) -> int:
        """The rank whose block this rank holds at a step (blocks move to the next rank)."""
        return (self.rank - step) % self.size

    def block_shape(self, kv_like: Tensor, rank: int) -> tuple[int, int, int, int]:
        b, num_kv_heads, _, e = kv_like.shape
        return b, num_kv_heads, self.layout.local_length(rank), e

    def block_numel(self, kv_like: Tensor, rank: int) -> int:
        """Elements of rank's packed K/V block, and of its packed dK/dV accumulator."""
        return 2 * math.prod(self.block_shape(kv_like, rank))

    def exchange(self, send: Tensor, recv_numel: int, tag: int) -> _Hop:
        """Post sending to the next rank and receiving from the previous one, as one batch:
        NCCL would deadlock on a ring of separately posted sends; gloo posts them one by one."""
        recv = send.new_empty(recv_numel)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, self.next_peer, self.group, tag),
                dist.P2POp(dist.irecv, recv, self.prev_peer, self.group, tag),
            ]
        )
        return _Hop(works, send, recv)


class _Hop(NamedTuple):
    """One posted exchange; it holds both buffers so that neither is freed while in flight."""

    works: list[Any]
    send: Tensor
    recv: Tensor

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        return self.recv


def _pack(k: Tensor, v: Tensor) -> Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buffer: Tensor, shape_bkte: tuple[int, ...]) -> tuple[Tensor, ...]:
    return tuple(half.view(shape_bkte) for half in buffer.chunk(2))


def _ring_forward(q, k, v, ring: _Ring, kernel: BlockKernel, scale: float):
    if ring.size == 1:  # one causal block (see block_pairs): nothing to merge or to send
        out, lse = kernel.forward(q, k, v, True, scale)
        return out.to(q.dtype), lse
    out_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse_acc = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    kv = _pack(k, v)
    for step in range(ring.size):
        source, hop = ring.source(step), None
        if step < ring.size - 1:  # post the next hop first: it travels while this block runs
            hop = ring.exchange(kv, ring.block_numel(k, ring.source(step + 1)), _KV_TAG)
        k_block, v_block = _unpack(kv, ring.block_shape(k, source))
        for pair in block_pairs(ring.layout, ring.rank, source):
            rows, cols = slice(pair.q_start, pair.q_end), slice(pair.kv_start, pair.kv_end)
            out_pair, lse_pair = kernel.forward(
                q[:, :, rows], k_block[:, :, cols], v_block[:, :, cols], pair.causal, scale
            )
            # Online softmax: rescale what the rows hold and the new part to the merged lse.
            lse_old = lse_acc[:, :, rows]
            lse_new = torch.logaddexp(lse_old, lse_pair)
            out_acc[:, :, rows] = (
                out_acc[:, :, rows] * torch.exp(lse_old - lse_new)[..., None]
                + out_pair.float() * torch.exp(lse_pair - lse_new)[..., None]
            )
            lse_acc[:, :, rows] = lse_new
        if hop is not None:
            kv = hop.wait()
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(dout, q, k, v, out, lse, ring: _Ring, kernel: BlockKernel, scale: float):
    if ring.size == 1:
        grads = kernel.backward(dout, q, k, v, out, lse, True, scale)
        return tuple(grad.to(x.dtype) for grad, x in zip(grads, (q, k, v), strict=True))
    grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = _pack(k, v)
    grad_hop = None  # the accumulator of the block this rank works on next, in flight
    for step in range(ring.size):
        source, kv_hop = ring.source(step), None
        if step < ring.size - 1:
            kv_hop = ring.exchange(kv, ring.block_numel(k, ring.source(step + 1)), _KV_TAG)
        shape = ring.block_shape(k, source)
        k_block, v_block = _unpack(kv, shape)
        grad_kv = torch.zeros(ring.block_numel(k, source), dtype=torch.float32, device=q.device)
        grad_k_block, grad_v_block = _unpack(grad_kv, shape)
        for pair in block_pairs(ring.layout, ring.rank, source):
            rows, cols = slice(pair.q_start, pair.q_end), slice(pair.kv_start, pair.kv_end)
            dout_rows, q_rows, out_rows, lse_rows = (x[:, :, rows] for x in (dout, q, out, lse))
            k_cols, v_cols = k_block[:, :, cols], v_block[:, :, cols]
            grad_q_pair, grad_k_pair, grad_v_pair = kernel.backward(
                dout_rows, q_rows, k_cols, v_cols, out_rows, lse_rows, pair.causal, scale
            )
            grad_q[:, :, rows] += grad_q_pair
            grad_k_block[:, :, cols] += grad_k_pair
            grad_v_block[:, :, cols] += grad_v_pair
        # The previous rank worked on this block last step; its accumulator is needed only
        # now, after this rank's own share, so the transfer overlapped that computation.
        if grad_hop is not None:
            grad_kv += grad_hop.wait()
        next_numel = ring.block_numel(k, ring.source(step + 1))
        grad_hop = ring.exchange(grad_kv, next_numel, _GRAD_TAG)
        if kv_hop is not None:
            kv = kv_hop.wait()
    assert grad_hop is not None  # the extra hop: this rank's own block's finished accumulator
    grad_k, grad_v = _unpack(grad_hop.wait(), ring.block_shape(k, ring.rank))
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, ring: _Ring, kernel: BlockKernel, scale: float):
        out, lse = _ring_forward(q, k, v, ring, kernel, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.kernel, ctx.scale = ring, kernel, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout):
        q, k, v, out, lse = ctx.saved_tensors
        # Contiguous: autograd may hand in an expanded (stride 0) gradient, e.g. of out.sum().
        dout = dout.contiguous()
        grads = _ring_backward(dout, q, k, v, out, lse, ctx.ring, ctx.kernel, ctx.scale)
        return *grads, None, None, None


def ring_attention(
    q_bhte: Tensor,
    k_bkte: Tensor,
    v_bkte: Tensor,
    *,
    layout: ContextLayout,
    group: dist.ProcessGroup | None,
    kernel: str = "auto",
    scale: float | None = None,
) -> Tensor:
    """Causal attention of this rank's queries over the whole sequence: [b, h, t_local, e].

    q/k/v hold this rank's ``layout.local_length(rank)`` tokens in layout order; ``group`` is
    the CP group (None or size 1: plain local causal attention through the same kernels)."""
    ring = _Ring(layout, group)
    t_local = layout.local_length(ring.rank)
    shapes = f"q {tuple(q_bhte.shape)}, k {tuple(k_bkte.shape)}, v {tuple(v_bkte.shape)}"
    b, h, t, e = q_bhte.shape if q_bhte.dim() == 4 else (0, 0, 0, 0)
    if k_bkte.shape != v_bkte.shape or k_bkte.dim() != 4 or q_bhte.dim() != 4:
        raise ValueError(f"want q [b,h,t,e] and k, v alike [b,k,t,e]; got {shapes}")
    if (k_bkte.shape[0], k_bkte.shape[2], k_bkte.shape[3]) != (b, t, e) or t != t_local:
        raise ValueError(
            f"{shapes}: want one batch and head dim, rank {ring.rank}'s {t_local} tokens"
        )
    if h % k_bkte.shape[1] != 0:
        raise ValueError(f"{h} query heads are not a multiple of {k_bkte.shape[1]} kv heads")
    block_kernel = resolve_kernel(kernel, q_bhte)
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    # Contiguous: P2P sends need dense buffers, and the kernels' views slice along t.
    q_bhte, k_bkte, v_bkte = (x.contiguous() for x in (q_bhte, k_bkte, v_bkte))
    return _RingAttention.apply(q_bhte, k_bkte, v_bkte, ring, block_kernel, scale)
