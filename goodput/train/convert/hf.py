"""The HuggingFace Llama form of a dense goodput model: tensor names, RoPE layout, config.json.

Pure functions, no files: the caller reads the bytes. Two differences besides names:
- RoPE layout. goodput rotates interleaved (even, odd) pairs of each head's dims (Meta's
  layout); HF Llama rotates halves (``rotate_half``: dim i with dim i + head_dim/2). The rows of
  ``wq`` and ``wk`` are therefore permuted per head on the way out — the permutation HF's own
  ``convert_llama_weights_to_hf.py`` applies — and un-permuted on the way in. Nothing else moves.
- Tied embeddings. HF writes no ``lm_head.weight`` when ``tie_word_embeddings`` is set; goodput's
  state dict names the one tensor twice (``embedding.weight`` and ``output.weight``).

Only what goodput's model computes is accepted on import; anything else (biases, another
activation, RoPE types goodput lacks, MoE) is refused with the reason, never approximated.
Imports trust nothing: every number of ``config.json`` is checked as the ``[model]`` field it
fills would be (type, range: ``goodput.config``), and a safetensors header is checked whole —
length, JSON, dtypes, shapes against byte counts, offsets inside the file — before the
safetensors library reads a byte of data.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, TypeGuard

import torch

from goodput.config import coerce_field
from goodput.errors import GoodputError
from goodput.train.config.model import ModelConfig

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
# The config.json keys read into a ModelConfig field each: key -> field.
HF_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "intermediate_size": "ffn_dim",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "max_position_embeddings": "max_seq_len",
    "rms_norm_eps": "norm_eps",
    "initializer_range": "init_std",
    "tie_word_embeddings": "tie_embeddings",
}
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
# transformers' LlamaConfig defaults for keys a config.json may leave out: rms_norm_eps differs
# from goodput's, and max_position_embeddings is needed before the ModelConfig exists.
HF_DEFAULTS = {"norm_eps": 1e-6, "max_seq_len": 2048}
# The safetensors dtypes goodput imports (weights are floating point), with their byte sizes.
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
SAFETENSORS_MAX_HEADER = 100_000_000  # bytes; the safetensors library's own limit
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
        ours = _goodput_name_or_refuse(name, where)
        heads = _rope_heads(cfg, ours)
        state[ours] = halves_to_interleaved(tensor, heads) if heads else tensor
    if cfg.tie_embeddings and "embedding.weight" in state:
        # A tied HF folder may or may not also store lm_head; either way it is the embedding.
        state["output.weight"] = state["embedding.weight"]
    return state


def _goodput_name_or_refuse(name: str, where: str) -> str:
    try:
        return goodput_name(name)
    except KeyError:
        raise GoodputError.usage(
            where,
            f"tensor {_quote(name)} has no counterpart in goodput's Llama",
            "import only LlamaForCausalLM checkpoints without biases or extra modules",
        ) from None


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


def model_config(hf: Any, where: str) -> ModelConfig:
    """The goodput ``ModelConfig`` of an HF Llama ``config.json``; refuses what goodput lacks."""

    def refuse(what: str, fix: str = "only plain Llama models can be imported") -> GoodputError:
        return GoodputError.usage(where, what, fix)

    if not isinstance(hf, dict):
        raise refuse("is not a JSON object", "pass the config.json of an HF model folder")
    if hf.get("model_type") != "llama":
        raise refuse(f"model_type is {_quote(hf.get('model_type'))}, not 'llama'")
    missing = [key for key in REQUIRED_KEYS if hf.get(key) is None]
    if missing:
        raise refuse(f"'{missing[0]}' is missing", "fix config.json")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act {_quote(hf['hidden_act'])} is not supported (goodput uses silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if hf.get(bias):
            raise refuse(f"{bias} = true is not supported (goodput's layers have no bias)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        factor = _quote(hf["partial_rotary_factor"])
        raise refuse(f"partial_rotary_factor {factor} is not supported")
    fields: dict[str, Any] = dict(HF_DEFAULTS)
    for key, name in HF_FIELDS.items():
        if hf.get(key) is not None:  # absent: HF's default, which is ModelConfig's otherwise
            fields[name] = coerce_field(ModelConfig, name, hf[key], where, key)
    dim, num_heads = fields["dim"], fields["num_heads"]
    if hf.get("head_dim") not in (None, dim // num_heads):
        raise refuse(
            f"head_dim {_quote(hf['head_dim'])} differs from hidden_size / num_attention_heads "
            f"= {dim // num_heads}",
            "goodput derives the head dim from dim and num_heads",
        )
    # None where the value is what ModelConfig derives anyway, so that a goodput config which
    # left it out comes back equal.
    if fields.get("num_kv_heads") == num_heads:
        del fields["num_kv_heads"]
    ffn_dim = fields.pop("ffn_dim")
    fields.update(_rope(hf, where, refuse, fields["max_seq_len"]))
    try:
        cfg = ModelConfig(**fields)
    except GoodputError as exc:
        raise GoodputError(f"{where} {exc.where}", exc.what, exc.fix, code=exc.code) from None
    if cfg.mlp_dim != ffn_dim:
        cfg = dataclasses.replace(cfg, ffn_dim=ffn_dim)
    return cfg


def _rope(hf: dict[str, Any], where: str, refuse: Any, max_seq_len: int) -> dict[str, Any]:
    # transformers 5 writes rope_parameters (theta inside); earlier versions rope_theta and
    # rope_scaling side by side. Both are read.
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise refuse(f"rope scaling {_quote(params)} is not an object", "fix config.json")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope = {"rope_theta": coerce_field(ModelConfig, "rope_theta", theta, where, "rope_theta")}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return rope
    if kind not in ("linear", "llama3"):
        raise refuse(
            f"rope scaling type {_quote(kind)} is not supported",
            "goodput implements rope_type 'default', 'linear' and 'llama3'",
        )
    rope["rope_scaling"] = kind
    rope["rope_scaling_factor"] = coerce_field(
        ModelConfig, "rope_scaling_factor", params.get("factor"), where, "rope_scaling.factor"
    )
    if kind == "llama3":
        low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
        if (low, high) != (LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR):
            raise refuse(
                f"llama3 rope scaling with low/high_freq_factor {_quote(low)}/{_quote(high)} "
                "is not supported",
                f"goodput fixes them at {LLAMA3_LOW_FREQ_FACTOR}/{LLAMA3_HIGH_FREQ_FACTOR}",
            )
        rope["rope_original_max_seq_len"] = coerce_field(
            ModelConfig,
            "rope_original_max_seq_len",
            params.get("original_max_position_embeddings", max_seq_len),
            where,
            "rope_scaling.original_max_position_embeddings",
        )
    return rope


def safetensors_header_length(prefix: bytes, file_size: int, where: str) -> int:
    """The header length a safetensors file's first 8 bytes (little-endian) announce, checked
    against the file's size."""
    if len(prefix) < 8:
        raise _bad_safetensors(where, f"is {file_size} bytes, shorter than a safetensors header")
    length = int.from_bytes(prefix, "little")
    if not 2 <= length <= min(SAFETENSORS_MAX_HEADER, file_size - 8):
        raise _bad_safetensors(
            where, f"announces a header of {length:,} bytes in a file of {file_size:,}"
        )
    return length


def check_safetensors_header(header: bytes, data_size: int, where: str) -> dict[str, list[int]]:
    """The shape of each tensor a safetensors header describes, by name; refuse a header that
    is not what the format promises: a JSON object of tensors with an imported dtype, a shape
    whose byte count is their span, and spans laid end to end over exactly the ``data_size``
    bytes after it."""
    try:
        entries = json.loads(header.decode("utf-8"))
    except UnicodeDecodeError:
        raise _bad_safetensors(where, "has a header that is not valid UTF-8") from None
    except (ValueError, RecursionError):
        raise _bad_safetensors(where, "has a header that is not valid JSON") from None
    if not isinstance(entries, dict):
        raise _bad_safetensors(where, "has a header that is not a JSON object")
    metadata = entries.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad_safetensors(where, "has __metadata__ that is not an object of strings")
    spans = sorted(_span(name, entry, data_size, where) for name, entry in entries.items())
    position = 0
    for begin, end, name in spans:
        if begin != position:
            raise _bad_safetensors(where, f"has tensor {_quote(name)} overlapping another or a gap")
        position = end
    if position != data_size:
        raise _bad_safetensors(where, f"has {data_size - position} bytes after its last tensor")
    return {name: entry["shape"] for name, entry in entries.items()}


def check_hf_shapes(
    shapes: dict[str, list[int]], expected: dict[str, tuple[int, ...]], where: str
) -> None:
    """Refuse, naming the file ``where`` and the tensor, an HF tensor with no goodput
    counterpart or whose shape (``shapes``, from its header) is not the one ``expected`` (the
    config's, by goodput name): checked before any tensor is read, since converting one of
    another shape (the RoPE permutation's view) would fail inside torch."""
    fix = "pass the weights this config.json describes"
    for name, shape in shapes.items():
        if _HF_IGNORED.fullmatch(name):
            continue
        ours = _goodput_name_or_refuse(name, where)
        if ours in expected and tuple(shape) != expected[ours]:
            raise GoodputError.usage(
                where,
                f"tensor {_quote(name)} has shape {_quote(shape)}, config.json needs "
                f"{list(expected[ours])}",
                fix,
            )


def _span(name: str, entry: Any, data_size: int, where: str) -> tuple[int, int, str]:
    """(begin, end, name) of one header entry, whose dtype and shape must fill that span."""
    if not isinstance(entry, dict):
        raise _bad_safetensors(where, f"has tensor {_quote(name)} described by {_quote(entry)}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise _bad_safetensors(
            where,
            f"has tensor {_quote(name)} of dtype {_quote(dtype)}; goodput imports "
            + ", ".join(SAFETENSORS_DTYPES),
        )
    if not (_ints(shape) and _ints(offsets) and len(offsets) == 2):
        raise _bad_safetensors(
            where,
            f"has tensor {_quote(name)} with shape {_quote(shape)} and data_offsets "
            f"{_quote(offsets)}; both must be lists of non-negative integers",
        )
    begin, end = offsets
    if not begin <= end <= data_size:
        raise _bad_safetensors(
            where,
            f"has tensor {_quote(name)} at bytes {begin}-{end} of a {data_size}-byte data section",
        )
    if _num_bytes(shape, SAFETENSORS_DTYPES[dtype], data_size) != end - begin:
        raise _bad_safetensors(
            where,
            f"has tensor {_quote(name)} of shape {_quote(shape)} {dtype} in {end - begin} bytes",
        )
    return begin, end, name


def _num_bytes(shape: list[int], item_size: int, limit: int) -> int:
    """The bytes ``shape`` needs, or any number above ``limit`` once it exceeds it: a hostile
    shape of many large dims must not grow a huge integer."""
    if 0 in shape:
        return 0
    count = item_size
    for dim in shape:
        count *= dim
        if count > limit:
            break
    return count


def _ints(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def _quote(value: Any, limit: int = 80) -> str:
    """A value from a file, cut short for a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bad_safetensors(where: str, what: str) -> GoodputError:
    return GoodputError(where, what, "the file is damaged or not safetensors; download it again")
