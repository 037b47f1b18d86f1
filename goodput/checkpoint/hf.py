"""The HuggingFace Llama form of a dense goodput model: tensor names, RoPE layout, config.json.

Pure functions, no files. Two differences besides names:
- RoPE layout. goodput rotates interleaved (even, odd) pairs of each head's dims (Meta's
  layout); HF Llama rotates halves (``rotate_half``: dim i with dim i + head_dim/2). The rows of
  ``wq`` and ``wk`` are therefore permuted per head on the way out — the permutation HF's own
  ``convert_llama_weights_to_hf.py`` applies — and un-permuted on the way in. Nothing else moves.
- Tied embeddings. HF writes no ``lm_head.weight`` when ``tie_word_embeddings`` is set; goodput's
  state dict names the one tensor twice (``embedding.weight`` and ``output.weight``).

Only what goodput's model computes is accepted on import; anything else (biases, another
activation, RoPE types goodput lacks, MoE) is refused with the reason, never approximated.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from goodput.errors import GoodputError
from goodput.train.model import ModelConfig

# goodput's llama3 RoPE scaling hard-codes these two (train/model.py, rope_frequencies).
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0

TOP_NAMES = {
    "embedding.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_GOODPUT_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Older HF checkpoints store the RoPE frequencies; they are recomputed from the config.
_HF_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def hf_name(name: str) -> str:
    """The HF Llama name of a goodput state-dict key (KeyError if it has none)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = _GOODPUT_BLOCK.fullmatch(name)
    if match is None or match.group(2) not in BLOCK_NAMES:
        raise KeyError(name)
    return f"model.layers.{match.group(1)}.{BLOCK_NAMES[match.group(2)]}"


def goodput_name(name: str) -> str:
    """The goodput state-dict key of an HF Llama tensor name (KeyError if it has none)."""
    for ours, theirs in TOP_NAMES.items():
        if name == theirs:
            return ours
    match = _HF_LAYER.fullmatch(name)
    for ours, theirs in BLOCK_NAMES.items():
        if match is not None and match.group(2) == theirs:
            return f"blocks.{match.group(1)}.{ours}"
    raise KeyError(name)


def interleaved_to_halves(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection so that, per head, the even dims come first
    and the odd ones second: dim 2i -> i, dim 2i+1 -> i + head_dim/2."""
    rows, cols = weight.shape
    head_dim = rows // num_heads
    return weight.view(num_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of ``interleaved_to_halves``."""
    rows, cols = weight.shape
    head_dim = rows // num_heads
    return weight.view(num_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_heads(cfg: ModelConfig, name: str) -> int | None:
    if name.endswith("attention.wq.weight"):
        return cfg.num_heads
    if name.endswith("attention.wk.weight"):
        return cfg.kv_heads
    return None


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A goodput model state dict as HF Llama tensors (contiguous, no shared storage)."""
    out = {}
    for name, tensor in state.items():
        if cfg.tie_embeddings and name == "output.weight":
            continue  # HF re-ties lm_head to embed_tokens from the config
        heads = _rope_heads(cfg, name)
        out[hf_name(name)] = interleaved_to_halves(tensor, heads) if heads else tensor.contiguous()
    return out


def from_hf(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, where: str
) -> dict[str, torch.Tensor]:
    """HF Llama tensors as a goodput state dict (tied: ``output.weight`` is the embedding)."""
    state = {}
    for name, tensor in tensors.items():
        if _HF_IGNORED.fullmatch(name):
            continue
        try:
            ours = goodput_name(name)
        except KeyError:
            raise GoodputError.usage(
                where,
                f"tensor '{name}' has no counterpart in goodput's Llama",
                "import only LlamaForCausalLM checkpoints without biases or extra modules",
            ) from None
        heads = _rope_heads(cfg, ours)
        state[ours] = halves_to_interleaved(tensor, heads) if heads else tensor
    if cfg.tie_embeddings and "embedding.weight" in state:
        # A tied HF folder may or may not also store lm_head; either way it is the embedding.
        state["output.weight"] = state["embedding.weight"]
    return state


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` computing what ``cfg`` computes."""
    if cfg.moe is not None:
        raise GoodputError.usage(
            "[model.moe]",
            "a mixture-of-experts model has no HF Llama form",
            "export dense models only, or use `goodput ckpt to-torch` for MoE weights",
        )
    rope_scaling: dict[str, Any] | None = None
    if cfg.rope_scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
    elif cfg.rope_scaling == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
            "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        # The checkpoint does not know its tokenizer: no guessed special tokens.
        "bos_token_id": None,
        "eos_token_id": None,
    }


def model_config(hf: dict[str, Any], where: str) -> ModelConfig:
    """The goodput ``ModelConfig`` of an HF Llama ``config.json``; refuses what goodput lacks."""

    def refuse(what: str, fix: str = "only plain Llama models can be imported") -> GoodputError:
        return GoodputError.usage(where, what, fix)

    if hf.get("model_type") != "llama":
        raise refuse(f"model_type is {hf.get('model_type')!r}, not 'llama'")
    for key in REQUIRED_KEYS:
        if not isinstance(hf.get(key), int):
            raise refuse(f"'{key}' is missing or not an integer", "fix config.json")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act {hf['hidden_act']!r} is not supported (goodput uses silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if hf.get(bias):
            raise refuse(f"{bias} = true is not supported (goodput's layers have no bias)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(f"partial_rotary_factor {hf['partial_rotary_factor']} is not supported")
    dim, num_heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // num_heads):
        raise refuse(
            f"head_dim {hf['head_dim']} differs from hidden_size / num_attention_heads "
            f"= {dim // num_heads}",
            "goodput derives the head dim from dim and num_heads",
        )
    rope = _rope(hf, refuse)
    num_kv_heads = hf.get("num_key_value_heads") or num_heads
    try:
        cfg = ModelConfig(
            vocab_size=hf["vocab_size"],
            dim=dim,
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            # None where the value is what ModelConfig derives anyway, so that a goodput config
            # which left it out comes back equal.
            num_kv_heads=None if num_kv_heads == num_heads else num_kv_heads,
            max_seq_len=hf.get("max_position_embeddings", 2048),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=hf.get("initializer_range", 0.02),
            **rope,
        )
    except GoodputError as exc:
        raise GoodputError(f"{where} {exc.where}", exc.what, exc.fix, code=exc.code) from None
    if cfg.mlp_dim != hf["intermediate_size"]:
        cfg = dataclasses.replace(cfg, ffn_dim=hf["intermediate_size"])
    return cfg


def _rope(hf: dict[str, Any], refuse: Any) -> dict[str, Any]:
    # transformers 5 writes rope_parameters (theta inside); earlier versions rope_theta and
    # rope_scaling side by side. Both are read.
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta}
    if kind in ("linear", "llama3") and not isinstance(params.get("factor"), int | float):
        raise refuse(f"{kind} rope scaling without a numeric 'factor'", "fix config.json")
    if kind == "linear":
        return {
            "rope_theta": theta,
            "rope_scaling": "linear",
            "rope_scaling_factor": float(params["factor"]),
        }
    if kind == "llama3":
        low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
        if (low, high) != (LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR):
            raise refuse(
                f"llama3 rope scaling with low/high_freq_factor {low}/{high} is not supported",
                f"goodput fixes them at {LLAMA3_LOW_FREQ_FACTOR}/{LLAMA3_HIGH_FREQ_FACTOR}",
            )
        return {
            "rope_theta": theta,
            "rope_scaling": "llama3",
            "rope_scaling_factor": float(params["factor"]),
            "rope_original_max_seq_len": int(
                params.get("original_max_position_embeddings", hf["max_position_embeddings"])
            ),
        }
    raise refuse(
        f"rope scaling type {kind!r} is not supported",
        "goodput implements rope_type 'default', 'linear' and 'llama3'",
    )
