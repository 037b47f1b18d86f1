"""Llama-style decoder and its mixture-of-experts variant.

Pre-norm blocks: RMSNorm -> grouped-query attention with rotary positions -> residual, RMSNorm ->
SwiGLU MLP (or MoE) -> residual; a final RMSNorm and an output head, optionally tied to the
embedding. Output projections of every block are initialised with std / sqrt(2 · layers) so the
residual stream does not grow with depth.

MoE: a linear router picks the top-k experts per token (softmax over the k chosen logits);
optional shared expert always on. Balancing: an auxiliary loss (Switch style, E · Σ f_e · p_e,
scaled by ``aux_loss_coef``) and/or the aux-loss-free scheme — a per-expert bias added to the
logits for *selection only*, nudged after each step toward equal load (``update_router_bias``).
Token dropping: with ``capacity_factor`` set, each expert takes at most
ceil(factor · tokens · k / E) tokens in token order; the rest of its assignments are dropped
(those tokens keep their residual); without it, nothing is dropped. The experts are grouped
weights, ``[experts, ...]`` per projection (``goodput.train.experts``), which expert parallelism
splits by expert. Where a micro-batch's tokens are spread over ranks (context and sequence
parallelism: ``TokenSplit``), each layer gathers every rank's chosen experts, so capacity and
the balancing loss are decided over the whole micro-batch, as in one process. The balancing
loss reaches the gradients through the layer's own output (``balancing_gradient``), weighted as
the step's objective weighs it (``aux_scale``), so a pipeline stage's layers need no path to
the loss function.

Positions. ``forward`` takes each token's position in its sequence (default: 0..t-1): under
context parallelism a rank holds two chunks of every sequence, and rotary embeddings need
their global positions; its attention then runs ring attention over the context-parallel
group (``goodput.train.ring_attention``), set by ``parallelize``.

KV cache (inference only: ``goodput.eval.generate``). ``forward(tokens, cache=KVCache)`` runs
the new tokens at positions ``cache.length, ...`` and appends each layer's keys (after RoPE)
and values to the cache, so a decoded token costs one position's forward. Without a cache —
training, and every caller but generation — the same ops run as without this feature: the
cache is an extra argument defaulting to None, and only its own branch touches it.

Shape suffixes: b batch, t sequence, d model dim, h heads, k kv heads, e head dim, f ffn dim,
v vocab, n tokens (b·t), x experts, c positions a KV cache has room for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from goodput.train.config.model import ModelConfig, MoEConfig
from goodput.train.experts import GroupedExperts
from goodput.train.init import initialize_model
from goodput.train.ring_attention import ContextLayout, ring_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the compute dtype: bf16 variance is too coarse.
        x_fp32 = x.float()
        scale = torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_fp32 * scale).type_as(x) * self.weight


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Rotation frequency of each head-dim pair, with the configured context scaling."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_scaling_factor
    if cfg.rope_scaling == "llama3":
        # Long wavelengths are slowed by the factor, short ones kept, a smooth blend between.
        low_freq_factor, high_freq_factor = 1.0, 4.0
        wavelength = 2 * math.pi / inv_freq
        low = cfg.rope_original_max_seq_len / low_freq_factor
        high = cfg.rope_original_max_seq_len / high_freq_factor
        smooth = (cfg.rope_original_max_seq_len / wavelength - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / cfg.rope_scaling_factor + smooth * inv_freq
        scaled = torch.where(wavelength > low, inv_freq / cfg.rope_scaling_factor, inv_freq)
        middle = (wavelength <= low) & (wavelength >= high)
        return torch.where(middle, blended, scaled)
    return inv_freq


def apply_rope(x_bthe: torch.Tensor, cos_te: torch.Tensor, sin_te: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of the head dim by its position's angle."""
    x_even, x_odd = x_bthe.float()[..., 0::2], x_bthe.float()[..., 1::2]
    cos, sin = cos_te[:, None, :], sin_te[:, None, :]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x_bthe)


class LayerCache:
    """One attention layer's keys (after RoPE) and values of the first ``length`` positions,
    in buffers preallocated for ``capacity`` positions."""

    def __init__(self, keys_bkce: torch.Tensor, values_bkce: torch.Tensor):
        self.keys_bkce, self.values_bkce = keys_bkce, values_bkce
        self.length = 0

    def attend(
        self, q_bhte: torch.Tensor, k_bkte: torch.Tensor, v_bkte: torch.Tensor
    ) -> torch.Tensor:
        """Append the t new positions' keys and values, then attend the new queries causally
        over every cached position."""
        start, t = self.length, q_bhte.shape[2]
        end = start + t
        if end > self.keys_bkce.shape[2]:
            raise ValueError(f"KV cache full: {end} positions, room for {self.keys_bkce.shape[2]}")
        self.keys_bkce[:, :, start:end] = k_bkte
        self.values_bkce[:, :, start:end] = v_bkte
        self.length = end
        # One new token sees every cached one; several (a prompt) see those up to their own.
        mask_tc = None
        if t > 1:
            key_c = torch.arange(end, device=q_bhte.device)
            mask_tc = key_c[None, :] <= torch.arange(start, end, device=q_bhte.device)[:, None]
        return F.scaled_dot_product_attention(
            q_bhte,
            self.keys_bkce[:, :, :end],
            self.values_bkce[:, :, :end],
            attn_mask=mask_tc,
            enable_gqa=k_bkte.shape[1] != q_bhte.shape[1],
        )


class KVCache:
    """Every layer's ``LayerCache`` (keyed by layer number, as ``Transformer.blocks``), for
    ``batch_size`` sequences of at most ``capacity`` positions; zeros in ``dtype`` on
    ``device``."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        layers: list[str],
        batch_size: int,
        capacity: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        shape = (batch_size, cfg.kv_heads, capacity, cfg.head_dim)
        self.capacity = capacity
        self.layers = {
            layer: LayerCache(
                torch.zeros(shape, device=device, dtype=dtype),
                torch.zeros(shape, device=device, dtype=dtype),
            )
            for layer in layers
        }

    @property
    def length(self) -> int:
        """Positions cached so far: the position the next token takes."""
        return next(iter(self.layers.values())).length if self.layers else 0


@dataclass(frozen=True, slots=True)
class ContextParallel:
    """What an attention needs to run over a sequence split across ranks."""

    layout: ContextLayout
    group: dist.ProcessGroup


class Attention(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=False)
        # Each attention holds the rotary frequencies (no checkpoint does): a pipeline stage is
        # any run of blocks, and with sequence parallelism only here is the whole sequence seen.
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.init_buffers()
        self.context: ContextParallel | None = None  # set by parallelize under cp > 1
        # Per head (this rank's heads), the largest attention logit since the last QK-clip;
        # None: not tracked (``qk_clip.track_logits`` turns it on).
        self.max_logit_h: torch.Tensor | None = None

    def init_buffers(self) -> None:
        with torch.device(self.inv_freq.device):
            self.inv_freq.copy_(rope_frequencies(self.cfg))

    def forward(
        self,
        x_btd: torch.Tensor,
        positions_t: torch.Tensor | None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        b, t, _ = x_btd.shape
        head_dim = self.cfg.head_dim
        if positions_t is None:  # here, not before: sequence parallelism gathered t just now
            positions_t = torch.arange(t, device=x_btd.device)
        angles_te = positions_t[:, None].float() * self.inv_freq[None, :]
        cos_te, sin_te = angles_te.cos(), angles_te.sin()
        # -1 heads: under tensor parallelism this rank holds heads / tp of them.
        q_bhte = apply_rope(self.wq(x_btd).view(b, t, -1, head_dim), cos_te, sin_te).transpose(1, 2)
        k_bkte = apply_rope(self.wk(x_btd).view(b, t, -1, head_dim), cos_te, sin_te).transpose(1, 2)
        v_bkte = self.wv(x_btd).view(b, t, -1, head_dim).transpose(1, 2)
        if cache is not None:  # inference: no QK-clip tracking, no context parallelism
            assert self.context is None, "a KV cache needs the whole sequence on one rank"
            out_bhte = cache.attend(q_bhte, k_bkte, v_bkte)
            return self.wo(out_bhte.transpose(1, 2).reshape(b, t, -1))
        if self.max_logit_h is not None:
            step_h = max_logits(q_bhte, k_bkte)
            seen = self.max_logit_h.numel() > 0
            self.max_logit_h = torch.maximum(self.max_logit_h, step_h) if seen else step_h
        if self.context is None:
            out_bhte = F.scaled_dot_product_attention(
                q_bhte,
                k_bkte,
                v_bkte,
                is_causal=True,
                enable_gqa=self.cfg.kv_heads != self.cfg.num_heads,
            )
        else:
            out_bhte = ring_attention(
                q_bhte, k_bkte, v_bkte, layout=self.context.layout, group=self.context.group
            )
        return self.wo(out_bhte.transpose(1, 2).reshape(b, t, -1))


def max_logits(q_bhte: torch.Tensor, k_bkte: torch.Tensor) -> torch.Tensor:
    """The largest causal attention logit q.k / sqrt(e) of each query head, over the batch and
    every (query, key) pair; the q.kT products are made a block of queries at a time so a long
    sequence never holds its whole t x t matrix at once."""
    with torch.no_grad():
        _, h, t, e = q_bhte.shape
        k_bhte = k_bkte.repeat_interleave(h // k_bkte.shape[1], dim=1).float()
        rows = max(1, LOGIT_BLOCK_ELEMENTS // max(1, q_bhte.shape[0] * h * t))
        best_h = torch.full((h,), -math.inf, device=q_bhte.device)
        for start in range(0, t, rows):
            q_block = q_bhte[:, :, start : start + rows].float()
            logits = q_block @ k_bhte.transpose(-1, -2) / math.sqrt(e)
            query_t = torch.arange(start, start + q_block.shape[2], device=q_bhte.device)
            future = torch.arange(t, device=q_bhte.device)[None, :] > query_t[:, None]
            logits = logits.masked_fill(future, -math.inf)
            best_h = torch.maximum(best_h, logits.amax(dim=(0, 2, 3)))
        return best_h


LOGIT_BLOCK_ELEMENTS = 2**24  # q.kT entries made at once by max_logits


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down: the block's output projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass(frozen=True, slots=True)
class TokenSplit:
    """The ranks one micro-batch's tokens are spread over — context parallelism's chunks and,
    under tensor parallelism, sequence parallelism's slices of them — so that an MoE layer
    routes them all as one process routes the whole micro-batch (set by ``parallelize``)."""

    group: dist.ProcessGroup  # the cp x tp ranks, tp fastest
    tp: int  # sequence parallelism's slices of each context-parallel rank's tokens
    tp_rank: int


@dataclass(frozen=True, slots=True)
class Routed:
    """One training forward's routing over its whole micro-batch: the assignments each expert
    was chosen for, and how many of them capacity dropped (``MoE.routed``)."""

    counts_x: torch.Tensor  # float32, [experts]
    dropped: torch.Tensor  # int64, ()


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (+ optional shared expert); see the module docstring."""

    selection_bias: torch.Tensor

    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(dim, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(dim, cfg.expert_ffn_dim, cfg.num_experts)
        self.shared = SwiGLU(dim, cfg.expert_ffn_dim) if cfg.shared_expert else None
        self.register_buffer("selection_bias", torch.zeros(cfg.num_experts), persistent=True)
        self.split: TokenSplit | None = None  # set by parallelize under cp or tp > 1
        # The weight of the balancing loss in the step's objective (the step sets it): the
        # loss reaches the gradients through backward itself, so that a pipeline stage's
        # layers contribute theirs without the last stage's loss function knowing of them.
        self.aux_scale = 0.0
        self.init_buffers()

    def init_buffers(self) -> None:
        """Start balanced: no selection bias, nothing routed yet (a resume then loads the bias)."""
        self.selection_bias.zero_()
        self.aux_loss = torch.zeros(())  # the last forward's balancing loss
        # Each training forward's routing since the step began (not a recompute in backward).
        self.routed: list[Routed] = []

    def forward(self, x_btd: torch.Tensor, positions_t: torch.Tensor | None = None) -> torch.Tensor:
        """``positions_t``: the tokens' positions in their sequences (None: 0..t-1), which order
        them among the tokens of the split's other ranks."""
        b, t, _ = x_btd.shape
        x_nd = x_btd.reshape(b * t, -1)
        logits_nx = self.router(x_nd).float()
        chosen_nk = torch.topk(logits_nx + self.selection_bias, self.cfg.top_k, dim=-1).indices
        gates_nk = torch.softmax(logits_nx.gather(1, chosen_nk), dim=-1).type_as(x_nd)
        expert_a = chosen_nk.flatten()  # assignment a = token * k + slot
        # Capacity and the balancing loss are decided over every assignment of the micro-batch,
        # wherever its tokens are: ``own_a`` places this rank's among them.
        every_a, own_a = expert_a, None
        if self.split is not None:
            every_a, own_a = self._every_assignment(chosen_nk, b, t, positions_t)
        counts_x = torch.bincount(every_a, minlength=self.cfg.num_experts)
        capacity = (
            math.ceil(self.cfg.capacity_factor * every_a.numel() / self.cfg.num_experts)
            if self.cfg.capacity_factor
            else every_a.numel()
        )
        kept_every_a = first_come(every_a, counts_x, capacity)
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            # A training forward; not its recompute in backward (activation checkpointing),
            # which runs inside the autograd engine's graph task (torch has no public flag).
            dropped = every_a.numel() - kept_every_a.sum()
            self.routed.append(Routed(counts_x.detach().float(), dropped.detach()))
        # Switch's E * sum_x f_x p_x: f the micro-batch's share of assignments per expert, p its
        # tokens' mean router probability, to which this rank's tokens add their share (the
        # shares' gradients add up over the split's ranks like any other token's).
        fraction_x = counts_x.float() / every_a.numel()
        num_tokens = every_a.numel() // self.cfg.top_k
        probability_x = torch.softmax(logits_nx, dim=-1).sum(0) / num_tokens
        self.aux_loss = (
            self.cfg.aux_loss_coef * self.cfg.num_experts * (fraction_x * probability_x).sum()
        )
        kept_a = kept_every_a if own_a is None else kept_every_a[own_a]
        # This rank's kept assignments grouped by expert, in token order within each.
        order_a = torch.argsort(expert_a, stable=True)
        order_a = order_a[kept_a[order_a]]
        token_a = order_a // self.cfg.top_k
        kept_x = torch.bincount(expert_a[order_a], minlength=self.cfg.num_experts)
        computed = self.experts(x_nd[token_a], kept_x)
        weighted = computed * gates_nk.flatten()[order_a, None]
        out_nd = torch.zeros_like(x_nd).index_add(0, token_a, weighted)
        if self.shared is not None:
            out_nd = out_nd + self.shared(x_nd)
        return balancing_gradient(out_nd, self.aux_loss, self.aux_scale).view_as(x_btd)

    def _every_assignment(
        self, chosen_nk: torch.Tensor, b: int, t: int, positions_t: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert of every assignment of the micro-batch in token order (row, then
        position), gathered from the split's ranks, and the index of each of this rank's
        assignments among them."""
        assert self.split is not None
        split, k = self.split, self.cfg.top_k
        device = chosen_nk.device
        if positions_t is None:  # sequence parallelism's slice t of the whole sequence
            positions_t = torch.arange(t * split.tp, device=device)
        own_t = positions_t[split.tp_rank * t : (split.tp_rank + 1) * t]
        rows_b = torch.arange(b, device=device)
        key_n = (rows_b[:, None] * 2**32 + own_t[None, :]).flatten()
        ranks = dist.get_world_size(split.group)
        every_key_n = key_n.new_empty(ranks * len(key_n))
        every_chosen_nk = chosen_nk.new_empty(ranks * len(key_n), k)
        dist.all_gather_single(every_key_n, key_n, group=split.group)
        dist.all_gather_single(every_chosen_nk, chosen_nk.contiguous(), group=split.group)
        token_order = torch.argsort(every_key_n)
        place_n = torch.empty_like(token_order)
        place_n[token_order] = torch.arange(len(token_order), device=device)
        own_n = place_n.view(ranks, -1)[dist.get_rank(split.group)]
        own_a = (own_n[:, None] * k + torch.arange(k, device=device)[None, :]).flatten()
        return every_chosen_nk[token_order].flatten(), own_a

    @torch.no_grad()
    def update_router_bias(self, load_x: torch.Tensor) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower the others'.

        ``load_x`` is the step's load over every micro-batch and rank, so the bias — a buffer
        every rank holds — moves identically everywhere."""
        if self.cfg.bias_update_rate:
            self.selection_bias += self.cfg.bias_update_rate * torch.sign(load_x.mean() - load_x)


def first_come(expert_a: torch.Tensor, counts_x: torch.Tensor, capacity: int) -> torch.Tensor:
    """Which of the assignments ``expert_a`` (in token order; ``counts_x`` per expert) their
    experts keep: each its first ``capacity``."""
    order_a = torch.argsort(expert_a, stable=True)
    starts_x = counts_x.cumsum(0) - counts_x
    place_a = torch.arange(len(order_a), device=expert_a.device) - starts_x[expert_a[order_a]]
    kept_a = torch.empty_like(expert_a, dtype=torch.bool)
    kept_a[order_a] = place_a < capacity
    return kept_a


class _BalancingGradient(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        aux_loss: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        ctx.aux = (aux_loss.shape, aux_loss.dtype, aux_loss.device, scale)  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device, scale = ctx.aux  # type: ignore[attr-defined]
        return grad, torch.full(shape, scale, dtype=dtype, device=device), None


def balancing_gradient(x: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` itself, whose backward also gives ``aux_loss`` the gradient ``scale``: the
    balancing loss, weighted as the step's objective weighs it, joins backward wherever the
    layer's output does — in a pipeline stage as in a whole model."""
    result = _BalancingGradient.apply(x, aux_loss, scale)
    assert isinstance(result, torch.Tensor)
    return result


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp: nn.Module = MoE(cfg.dim, cfg.moe) if cfg.moe else SwiGLU(cfg.dim, cfg.mlp_dim)

    def forward(
        self,
        x_btd: torch.Tensor,
        positions_t: torch.Tensor | None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        if cache is None:
            x_btd = x_btd + self.attention(self.attention_norm(x_btd), positions_t)
        else:
            x_btd = x_btd + self.attention(self.attention_norm(x_btd), positions_t, cache)
        if isinstance(self.mlp, MoE):  # its routing orders tokens by position
            return x_btd + self.mlp(self.mlp_norm(x_btd), positions_t)
        return x_btd + self.mlp(self.mlp_norm(x_btd))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (``train.parallel.pipeline`` cuts one from
    a whole model): ``embedding`` only on the first stage, ``norm`` and ``output`` only on the
    last, and ``blocks`` keyed by their layer number, so every parameter keeps the name it has
    in the whole model (checkpoints load across layouts by name)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleDict({str(layer): Block(cfg) for layer in range(cfg.num_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.embedding.weight
        self.reset_parameters()

    def init_buffers(self) -> None:
        """Compute the buffers no checkpoint holds (the rotary frequencies), on their device."""
        for block in self.blocks.values():
            assert isinstance(block.attention, Attention)
            block.attention.init_buffers()
        for moe in self.moe_layers():
            moe.init_buffers()

    def allocate(self, device: torch.device) -> None:
        """Allocate a model built on the meta device, uninitialised, on ``device``: for a load
        that fills every parameter. Allocation gives every parameter name its own tensor, so a
        tied output head is tied again; the buffers no checkpoint holds are computed."""
        self.to_empty(device=device)
        if self.cfg.tie_embeddings and self.embedding is not None and self.output is not None:
            self.output.weight = self.embedding.weight
        self.init_buffers()

    def reset_parameters(self, seed: int | None = None) -> None:
        """Draw the init (``goodput.train.init``) into this whole model, allocated: from
        ``seed``, or from one drawn from torch's global generator when built alone, so
        ``torch.manual_seed`` still decides it. Built on the meta device: nothing to draw."""
        if next(self.parameters()).is_meta:
            return
        if seed is None:
            seed = int(torch.randint(2**62, (), device="cpu").item())
        initialize_model([self], self.cfg, seed)

    def kv_cache(self, *, batch_size: int, capacity: int) -> KVCache:
        """An empty KV cache for this model's blocks, on the device and in the dtype of its
        parameters."""
        parameter = next(self.parameters())
        return KVCache(
            self.cfg,
            layers=list(self.blocks.keys()),
            batch_size=batch_size,
            capacity=capacity,
            device=parameter.device,
            dtype=parameter.dtype,
        )

    def forward(
        self,
        x: torch.Tensor,
        positions_t: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Token ids ``[b, t]`` -> logits ``[b, t, v]``; a stage without the embedding takes the
        previous stage's hidden states instead, and one without the head returns its own.
        ``positions_t``: each token's position in its sequence (None: 0..t-1). ``cache``
        (inference only): the tokens follow the ``cache.length`` cached positions, take the
        positions after them (``positions_t`` must be None) and are appended to the cache."""
        x_btd = self.embedding(x) if self.embedding is not None else x
        if cache is not None:
            assert positions_t is None, "with a KV cache, positions follow the cached ones"
            start = cache.length
            positions_t = torch.arange(start, start + x_btd.shape[1], device=x_btd.device)
            for layer, block in self.blocks.items():
                x_btd = block(x_btd, positions_t, cache.layers[layer])
        else:
            for block in self.blocks.values():
                x_btd = block(x_btd, positions_t)
        if self.norm is None or self.output is None:
            return x_btd
        return self.output(self.norm(x_btd))

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]
