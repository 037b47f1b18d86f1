"""Megatron's GPT model in goodput's names: the key map, the fused tensors split, and Megatron's
saved args checked against the ``[model]`` config. Pure functions; the files are read by
``megatron_files``.

Megatron-core names its tensors the same way in every format (``torch_dist``, Megatron-LM's
legacy ``model_optim_rng.pt``, a Megatron model saved by DeepSpeed); the formats differ only in
how the tensors are cut (see ``megatron_files``). Per layer, with goodput's name on the right:

    self_attention.linear_qkv.layer_norm_weight  attention_norm.weight  (input_layernorm.weight)
    self_attention.linear_qkv.weight             attention.wq / wk / wv (fused, per query group)
    self_attention.linear_proj.weight            attention.wo
    mlp.linear_fc1.layer_norm_weight             mlp_norm.weight        (pre_mlp_layernorm.weight)
    mlp.linear_fc1.weight                        mlp.w1 (gate) / mlp.w3 (up), stacked
    mlp.linear_fc2.weight                        mlp.w2

The names in brackets are the local (non Transformer-Engine) layer spec's; ``torch_dist`` always
uses the fused names. ``linear_qkv`` holds, for each of the ``ng`` query groups in turn, the
group's ``nq / ng`` query heads, then its key head, then its value head (``head_dim`` rows each).
Megatron's RoPE rotates halves of each head unless ``rotary_interleaved``; goodput rotates
interleaved pairs, so q and k rows are permuted as for HF (``hf.halves_to_interleaved``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import torch

from goodput.errors import GoodputError
from goodput.train.config.model import ModelConfig
from goodput.train.convert.hf import halves_to_interleaved

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
LAYERS = "decoder.layers."
ATTENTION_NORM = "self_attention.linear_qkv.layer_norm_weight"
QKV = "self_attention.linear_qkv.weight"
PROJ = "self_attention.linear_proj.weight"
MLP_NORM = "mlp.linear_fc1.layer_norm_weight"
FC1 = "mlp.linear_fc1.weight"
FC2 = "mlp.linear_fc2.weight"
LAYER_TENSORS = (ATTENTION_NORM, QKV, PROJ, MLP_NORM, FC1, FC2)
# The local layer spec's names for the two norms, which torch_dist saves under the fused names.
LOCAL_NAMES = {
    "input_layernorm.weight": ATTENTION_NORM,
    "pre_mlp_layernorm.weight": MLP_NORM,
}
# The dimension tensor parallelism cuts, per tensor (None: every TP rank holds it whole).
TP_DIM: dict[str, int | None] = {
    EMBEDDING: 0,
    OUTPUT: 0,
    FINAL_NORM: None,
    ATTENTION_NORM: None,
    QKV: 0,
    PROJ: 1,
    MLP_NORM: None,
    FC1: 0,  # each rank holds [its gate rows; its up rows]: merge_fc1 keeps them apart
    FC2: 1,
}

# Megatron-LM's args -> (goodput's [model] field, its value in ``cfg``).
ARGS_FIELDS: dict[str, tuple[str, Callable[[ModelConfig], Any]]] = {
    "num_layers": ("num_layers", lambda c: c.num_layers),
    "hidden_size": ("dim", lambda c: c.dim),
    "num_attention_heads": ("num_heads", lambda c: c.num_heads),
    "num_query_groups": ("num_kv_heads", lambda c: c.kv_heads),
    "kv_channels": ("dim / num_heads", lambda c: c.head_dim),
    "ffn_hidden_size": ("ffn_dim", lambda c: c.mlp_dim),
    "norm_epsilon": ("norm_eps", lambda c: c.norm_eps),
    "rotary_base": ("rope_theta", lambda c: c.rope_theta),
    "padded_vocab_size": ("vocab_size", lambda c: c.vocab_size),
    "untie_embeddings_and_output_weights": ("tie_embeddings", lambda c: c.tie_embeddings),
}
# The args that say the opposite of their [model] field.
ARGS_NEGATED = frozenset({"untie_embeddings_and_output_weights"})
# Args naming what goodput's Llama does not compute: arg -> (the value it needs, what differs).
ARGS_REQUIRED: dict[str, tuple[Any, str]] = {
    "normalization": ("RMSNorm", "goodput's blocks use RMSNorm"),
    "swiglu": (True, "goodput's MLP is SwiGLU"),
    "add_bias_linear": (False, "goodput's linear layers have no biases"),
    "add_qkv_bias": (False, "goodput's attention has no biases"),
    "qk_layernorm": (False, "goodput has no query/key norms"),
    "apply_layernorm_1p": (False, "goodput's norms scale by their weight, not 1 + weight"),
    "position_embedding_type": ("rope", "goodput uses rotary position embeddings"),
    "rotary_percent": (1.0, "goodput rotates every dimension of a head"),
    "num_experts": (None, "mixture-of-experts models are not imported yet"),
    "mtp_num_layers": (None, "multi-token-prediction layers are not imported"),
}


def args_dict(args: Any) -> dict[str, Any] | None:
    """The saved args as a dict (Megatron saves an ``argparse.Namespace``); None without."""
    if isinstance(args, argparse.Namespace):
        return vars(args)
    if isinstance(args, dict) and all(isinstance(key, str) for key in args):
        return args
    return None


def check_args(args: dict[str, Any], cfg: ModelConfig, where: str, config_where: str) -> None:
    """Refuse a source whose args describe another model than ``cfg``, naming the arg and
    the ``[model]`` field, each with its value."""
    for arg, (needed, why) in ARGS_REQUIRED.items():
        if arg in args and not _equal(args[arg], needed):
            raise GoodputError.usage(
                where,
                f"args.{arg} = {_shown(args[arg])}, but {why} ({arg} = {needed!r})",
                "import a dense Llama-style GPT (RMSNorm, SwiGLU, RoPE, no biases)",
            )
    if _equal(args.get("group_query_attention"), False):
        args = {**args, "num_query_groups": args.get("num_attention_heads")}
    if _equal(args.get("use_rope_scaling"), True):
        factor = args.get("rope_scaling_factor", 8.0)
        if cfg.rope_scaling != "llama3" or not _equal(factor, cfg.rope_scaling_factor):
            raise GoodputError.usage(
                f"{config_where} [model] rope_scaling",
                f"is {cfg.rope_scaling!r} (factor {cfg.rope_scaling_factor}), but "
                f"args.use_rope_scaling and rope_scaling_factor = {_shown(factor)} in {where}",
                f"set rope_scaling = 'llama3' and rope_scaling_factor = {_shown(factor)}",
            )
    elif cfg.rope_scaling != "none":
        raise GoodputError.usage(
            f"{config_where} [model] rope_scaling",
            f"is {cfg.rope_scaling!r}, but {where} was trained without RoPE scaling",
            "set rope_scaling = 'none'",
        )
    for arg, (field, ours) in ARGS_FIELDS.items():
        if arg not in args or args[arg] is None:
            continue
        theirs, mine = args[arg], ours(cfg)
        wanted = not theirs if arg in ARGS_NEGATED and type(theirs) is bool else theirs
        if not _equal(wanted, mine):
            if arg == "padded_vocab_size":
                raise GoodputError.usage(
                    f"{config_where} [model] vocab_size",
                    f"is {mine}, but Megatron padded the vocabulary of {where} to "
                    f"{_shown(theirs)} rows (args.padded_vocab_size: make_vocab_size_divisible_by "
                    "x TP)",
                    f"set vocab_size = {_shown(theirs)}",
                )
            raise _mismatch(where, arg, theirs, config_where, field, mine, wanted)


def _equal(value: Any, expected: Any) -> bool:
    """Whether a saved arg (anything a pickle holds) is the plain value goodput expects; an
    absent feature (None) is also 0 or False, as Megatron's defaults spell it."""
    if expected is None:
        return value is None or (type(value) in (int, bool) and not value)
    plain = (bool, int, float, str)
    return type(value) in plain and type(expected) in plain and value == expected


def _shown(value: Any) -> str:
    """A saved arg's value for a message: its repr, cut short (args come from the file)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _mismatch(
    where: str, arg: str, theirs: Any, config_where: str, field: str, mine: Any, wanted: Any
) -> GoodputError:
    return GoodputError.usage(
        f"{config_where} [model] {field}",
        f"is {_shown(mine)}, but args.{arg} = {_shown(theirs)} in {where}",
        f"set [model] so that {field} matches the source ({_shown(wanted)})",
    )


def split_qkv(
    qkv: torch.Tensor, cfg: ModelConfig, rotary_interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's fused ``linear_qkv`` weight as goodput's wq, wk, wv."""
    groups, per_group, head_dim = cfg.kv_heads, cfg.num_heads // cfg.kv_heads, cfg.head_dim
    grouped = qkv.reshape(groups, per_group + 2, head_dim, cfg.dim)
    wq = grouped[:, :per_group].reshape(cfg.num_heads * head_dim, cfg.dim)
    wk = grouped[:, per_group].reshape(groups * head_dim, cfg.dim)
    wv = grouped[:, per_group + 1].reshape(groups * head_dim, cfg.dim)
    if not rotary_interleaved:
        wq, wk = halves_to_interleaved(wq, cfg.num_heads), halves_to_interleaved(wk, groups)
    return wq.contiguous(), wk.contiguous(), wv.contiguous()


def merge_fc1(shards: list[torch.Tensor]) -> torch.Tensor:
    """The whole ``linear_fc1`` of its TP shards, each [its gate rows; its up rows]: all gate
    rows first, then all up rows, as ``torch_dist`` stores it."""
    halves = [shard.chunk(2, dim=0) for shard in shards]
    return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The whole shape of each Megatron tensor (one layer's, for those in the layers) of the
    model ``cfg`` describes: what a source must hold before any of it is allocated."""
    dim, heads, kv, head_dim = cfg.dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    return {
        EMBEDDING: (cfg.vocab_size, dim),
        OUTPUT: (cfg.vocab_size, dim),
        FINAL_NORM: (dim,),
        ATTENTION_NORM: (dim,),
        QKV: ((heads + 2 * kv) * head_dim, dim),
        PROJ: (dim, heads * head_dim),
        MLP_NORM: (dim,),
        FC1: (2 * cfg.mlp_dim, dim),
        FC2: (dim, cfg.mlp_dim),
    }


def goodput_tensors(
    tensor: Callable[[str, int | None], torch.Tensor], cfg: ModelConfig, rotary_interleaved: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """goodput's model state dict, one fp32 tensor at a time, each read whole by
    ``tensor(megatron_name, layer)`` (layer None: a tensor outside the layers) as it is needed."""
    embedding = tensor(EMBEDDING, None).float()
    yield "embedding.weight", embedding
    if cfg.tie_embeddings:
        yield "output.weight", embedding  # goodput's state dict names the tied tensor twice
    del embedding
    for layer in range(cfg.num_layers):
        block = f"blocks.{layer}."
        yield block + "attention_norm.weight", tensor(ATTENTION_NORM, layer).float()
        wq, wk, wv = split_qkv(tensor(QKV, layer).float(), cfg, rotary_interleaved)
        yield block + "attention.wq.weight", wq
        yield block + "attention.wk.weight", wk
        yield block + "attention.wv.weight", wv
        yield block + "attention.wo.weight", tensor(PROJ, layer).float()
        yield block + "mlp_norm.weight", tensor(MLP_NORM, layer).float()
        gate, up = tensor(FC1, layer).float().chunk(2, dim=0)
        yield block + "mlp.w1.weight", gate.contiguous()
        yield block + "mlp.w3.weight", up.contiguous()
        yield block + "mlp.w2.weight", tensor(FC2, layer).float()
    yield "norm.weight", tensor(FINAL_NORM, None).float()
    if not cfg.tie_embeddings:
        yield "output.weight", tensor(OUTPUT, None).float()
