"""The ``[model]`` table: the shape of a Llama-style decoder and of its mixture of experts.

Torch-free, so that what only reads a config (``goodput plan``, ``goodput model info``, the
FLOP and memory arithmetic) imports no torch; the modules are ``goodput.train.model``'s.
Invariants checked when read: heads divide dim, kv heads divide heads, an even head dim (rotary
pairs), top_k within the experts; every size bounded (``COUNT``, ``WIDTH``, ``LENGTH``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from goodput.config import limits
from goodput.errors import GoodputError

# Upper limits far above any real model (today's largest: dim 16-25k, ~126 layers, 256k vocab,
# 10M context), so that a typo or a hostile config.json cannot ask for an absurd allocation.
COUNT = limits(at_least=1, at_most=2**12)  # layers, heads
WIDTH = limits(at_least=1, at_most=2**20)  # model and FFN dims
LENGTH = limits(at_least=1, at_most=2**24)  # vocabulary, sequence lengths


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEConfig:
    num_experts: int = field(default=8, metadata=limits(at_least=1, at_most=2**16))
    top_k: int = field(default=2, metadata=limits(at_least=1))
    expert_ffn_dim: int = field(default=256, metadata=WIDTH)
    shared_expert: bool = False
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 0.0  # aux-loss-free balancing; 0 turns it off
    # None: no token is ever dropped
    capacity_factor: float | None = field(default=None, metadata=limits(above=0))


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    vocab_size: int = field(metadata=LENGTH)
    dim: int = field(metadata=WIDTH)
    num_layers: int = field(metadata=COUNT)
    num_heads: int = field(metadata=COUNT)
    # None: as many as num_heads (no grouping)
    num_kv_heads: int | None = field(default=None, metadata=COUNT)
    # None: 8/3 · dim rounded up to a multiple of 256
    ffn_dim: int | None = field(default=None, metadata=WIDTH)
    max_seq_len: int = field(default=2048, metadata=LENGTH)
    norm_eps: float = field(default=1e-5, metadata=limits(above=0))
    rope_theta: float = field(default=10000.0, metadata=limits(above=0))
    rope_scaling: Literal["none", "linear", "llama3"] = "none"
    rope_scaling_factor: float = field(default=1.0, metadata=limits(above=0))
    # llama3 scaling: the pre-training context
    rope_original_max_seq_len: int = field(default=8192, metadata=LENGTH)
    tie_embeddings: bool = False
    init_std: float = 0.02
    moe: MoEConfig | None = field(default=None)

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise GoodputError.usage(
                "[model]",
                f"dim {self.dim} is not divisible by num_heads {self.num_heads}",
                "choose num_heads dividing dim",
            )
        if self.num_heads % self.kv_heads:
            raise GoodputError.usage(
                "[model]",
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}",
                "choose num_kv_heads dividing num_heads",
            )
        if self.head_dim % 2:
            raise GoodputError.usage(
                "[model]",
                f"head dim {self.head_dim} is odd; rotary embeddings need pairs",
                "choose dim / num_heads even",
            )
        if self.moe is not None and self.moe.top_k > self.moe.num_experts:
            raise GoodputError.usage(
                "[model]",
                f"moe.top_k {self.moe.top_k} must be in [1, {self.moe.num_experts}]",
                "lower top_k or add experts",
            )

    def inert_keys(self) -> dict[str, str]:
        """The rope-scaling keys its kind does not read (config.py refuses them when set)."""
        rules: dict[str, str] = {}
        if self.rope_scaling == "none":
            rules["rope_scaling_factor"] = "rope_scaling = 'linear' or 'llama3'"
        if self.rope_scaling != "llama3":
            rules["rope_original_max_seq_len"] = "rope_scaling = 'llama3'"
        return rules

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def mlp_dim(self) -> int:
        return self.ffn_dim or 256 * math.ceil(8 * self.dim / 3 / 256)
