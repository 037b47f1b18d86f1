"""Parameters and FLOPs per token, computed from a config alone (the bytes each parameter takes
are the precision policy's, ``goodput.train.config.precision``).

Nothing is allocated, so a 405B-shaped config is as cheap to describe as a tiny one; a test
checks the counts against real modules of small configs. FLOPs per token follow the PaLM
convention used for MFU: 6 · N (N = active parameters doing matmuls: everything except the
input embedding lookup) + 12 · layers · dim · seq_len for attention scores and values (not
halved for causality).
"""

from __future__ import annotations

from dataclasses import dataclass

from goodput.train.config.model import ModelConfig


@dataclass(frozen=True, slots=True)
class ModelSize:
    total: int  # every parameter
    active: int  # used for one token (MoE: top-k of the routed experts)
    embedding: int  # the input embedding table


def model_size(cfg: ModelConfig) -> ModelSize:
    head = cfg.head_dim
    attention = cfg.dim * head * (2 * cfg.num_heads + 2 * cfg.kv_heads)
    norms = 2 * cfg.dim
    if cfg.moe is None:
        mlp_total = mlp_active = 3 * cfg.dim * cfg.mlp_dim
    else:
        expert = 3 * cfg.dim * cfg.moe.expert_ffn_dim
        shared = expert if cfg.moe.shared_expert else 0
        router = cfg.dim * cfg.moe.num_experts
        mlp_total = cfg.moe.num_experts * expert + shared + router
        mlp_active = cfg.moe.top_k * expert + shared + router
    embedding = cfg.vocab_size * cfg.dim
    output = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    outer = embedding + output + cfg.dim  # + final norm
    return ModelSize(
        total=outer + cfg.num_layers * (attention + norms + mlp_total),
        active=outer + cfg.num_layers * (attention + norms + mlp_active),
        embedding=embedding,
    )


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    size = model_size(cfg)
    # A tied table still does the output matmul, so only an untied input table is a pure lookup.
    lookup = 0 if cfg.tie_embeddings else size.embedding
    return 6 * (size.active - lookup) + 12 * cfg.num_layers * cfg.dim * seq_len
