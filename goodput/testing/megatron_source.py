"""Checkpoints written by Megatron-core itself, and the logits of Megatron's own forward: the
truth the importer's tests and ``python -m benchmarks ckpt`` compare with. Run as a script
(its own processes: Megatron keeps global parallel state), never imported by goodput itself;
it needs ``megatron-core`` and, for DeepSpeed, ``deepspeed`` (both test dependencies).

    python megatron_source.py save SPEC.json OUT --tp 2 --pp 1 --formats torch_dist,legacy
    python megatron_source.py logits SPEC.json CKPT_DIR TOKENS.pt OUT.pt

``save`` builds a Megatron GPTModel (GQA, SwiGLU, RMSNorm, RoPE, no biases) on every rank of a
TP x PP gloo world and writes it with Megatron's own save paths:
- ``torch_dist``: ``megatron.core.dist_checkpointing.save`` of the model's sharded state dict,
  nested as Megatron-LM's ``save_checkpoint`` nests it (args and iteration in common.pt), in
  ``OUT/torch_dist/iter_0000010`` beside ``latest_checkpointed_iteration.txt``;
- ``legacy``: each rank's ``state_dict_for_save_checkpoint()`` in the dict Megatron-LM's
  legacy save writes (args, checkpoint_version, iteration, model, rng_state), at the path its
  ``get_checkpoint_name`` gives (``iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt``). The
  ``megatron-core`` wheel holds the model and ``dist_checkpointing`` but not Megatron-LM's
  ``training/checkpointing.py``, so this outer dict and folder naming follow that file; every
  tensor in it is Megatron's own;
- ``deepspeed`` (TP = PP = 1): the model wrapped by ``deepspeed.initialize`` (ZeRO stage 1,
  AdamW), saved by the engine's ``save_checkpoint`` with the args as client
  state, as Megatron-DeepSpeed does, in ``OUT/deepspeed``.
Every save also writes ``torch_dist`` (the truth is always read back through it).

``logits`` builds the same model at TP = PP = 1, loads a ``torch_dist`` checkpoint with
Megatron's own ``dist_checkpointing.load`` (resharding any source layout) and saves the logits
of its forward on TOKENS (and the mean next-token cross-entropy).

Megatron assumes CUDA in four places that do not change what it computes; on this CPU-only
torch they are bridged here, nowhere else: ``torch.cuda.current_device`` answers "cpu" (RoPE's
frequencies are moved there), ``Tensor.cuda`` leaves a tensor where it is (a tied head's copy
is moved before its all-reduce), ``torch.cuda.synchronize`` is a no-op (dist_checkpointing's
writer syncs before copying), and the model-parallel RNG tracker's ``fork`` is a plain context
(attention dropout is 0, so the CUDA RNG it would fork is never drawn).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ITERATION = 10


def _cpu_bridges() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


def model_toml(spec: dict) -> str:
    """The goodput ``[model]`` table of the model ``spec`` describes (what ``--config`` names)."""
    return (
        "[model]\n"
        f"vocab_size = {spec['vocab_size']}\ndim = {spec['hidden_size']}\n"
        f"num_layers = {spec['num_layers']}\nnum_heads = {spec['num_attention_heads']}\n"
        f"num_kv_heads = {spec['num_query_groups']}\nffn_dim = {spec['ffn_hidden_size']}\n"
        f"max_seq_len = {spec['max_position_embeddings']}\nnorm_eps = {spec['norm_epsilon']}\n"
        f"rope_theta = {spec['rotary_base']}\n"
        f"tie_embeddings = {str(spec['tied']).lower()}\n"
    )


def megatron_args(spec: dict) -> argparse.Namespace:
    """The args Megatron-LM's training saves with a checkpoint, for this model."""
    return argparse.Namespace(
        num_layers=spec["num_layers"],
        hidden_size=spec["hidden_size"],
        ffn_hidden_size=spec["ffn_hidden_size"],
        num_attention_heads=spec["num_attention_heads"],
        group_query_attention=spec["num_query_groups"] != spec["num_attention_heads"],
        num_query_groups=spec["num_query_groups"],
        kv_channels=spec["hidden_size"] // spec["num_attention_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        position_embedding_type="rope",
        rotary_base=spec["rotary_base"],
        rotary_percent=1.0,
        rotary_interleaved=spec.get("rotary_interleaved", False),
        use_rope_scaling=False,
        normalization="RMSNorm",
        norm_epsilon=spec["norm_epsilon"],
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=False,
        apply_layernorm_1p=False,
        untie_embeddings_and_output_weights=not spec["tied"],
        padded_vocab_size=spec["vocab_size"],
        vocab_size=spec["vocab_size"] - 3,
        make_vocab_size_divisible_by=spec.get("make_vocab_size_divisible_by", 128),
        tensor_model_parallel_size=spec.get("tp", 1),
        pipeline_model_parallel_size=spec.get("pp", 1),
        num_experts=None,
        params_dtype=_params_dtype(spec),
        iteration=ITERATION,
        seed=1234,
    )


def _params_dtype(spec: dict) -> torch.dtype:
    """The dtype Megatron keeps the weights in (spec ``params_dtype``: float32 unless given)."""
    return getattr(torch, spec.get("params_dtype", "float32"))


def build_model(spec: dict):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=spec["num_layers"],
        hidden_size=spec["hidden_size"],
        ffn_hidden_size=spec["ffn_hidden_size"],
        num_attention_heads=spec["num_attention_heads"],
        num_query_groups=spec["num_query_groups"],
        normalization="RMSNorm",
        layernorm_epsilon=spec["norm_epsilon"],
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        rotary_interleaved=spec.get("rotary_interleaved", False),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=_params_dtype(spec),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=_params_dtype(spec),
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=spec["vocab_size"],
        max_sequence_length=spec["max_position_embeddings"],
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
        rotary_base=spec["rotary_base"],
        share_embeddings_and_output_weights=spec["tied"],
    )


def _init(rank: int, world: int, port: int, tp: int, pp: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tp, pp)
    _cpu_bridges()


def _save_rank(rank: int, spec: dict, out: str, tp: int, pp: int, formats: list, port: int):
    _init(rank, tp * pp, port, tp, pp)
    from megatron.core import dist_checkpointing, parallel_state

    torch.manual_seed(spec.get("seed", 0))
    model = build_model(spec)
    # Norms a little away from Megatron's init of ones, so that a swapped norm shows; the same
    # on every TP rank of a stage, as training keeps them.
    with torch.no_grad():
        generator = torch.Generator().manual_seed(
            100 + parallel_state.get_pipeline_model_parallel_rank()
        )
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    args = megatron_args({**spec, "tp": tp, "pp": pp})
    iteration_dir = f"iter_{ITERATION:07d}"
    for fmt in ["torch_dist", *[f for f in formats if f != "torch_dist"]]:
        root = Path(out) / fmt
        if fmt == "torch_dist":
            directory = root / iteration_dir
            if rank == 0:
                directory.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            state = {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": ITERATION,
                "model": model.sharded_state_dict(),
            }
            dist_checkpointing.save(state, str(directory))
        elif fmt == "legacy":
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
            directory = root / iteration_dir / name
            directory.mkdir(parents=True, exist_ok=True)
            import random

            import numpy as np

            state = {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": ITERATION,
                "model": model.state_dict_for_save_checkpoint(),
                "rng_state": [
                    {
                        "random_rng_state": random.getstate(),
                        "np_rng_state": np.random.get_state(),
                        "torch_rng_state": torch.get_rng_state(),
                    }
                ],
            }
            torch.save(state, directory / "model_optim_rng.pt")
        elif fmt == "deepspeed":
            _save_deepspeed(model, args, root)
        dist.barrier()
        if rank == 0 and fmt != "deepspeed":  # DeepSpeed writes its own `latest`
            (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.destroy_process_group()


def _save_deepspeed(model, args: argparse.Namespace, root: Path) -> None:
    import deepspeed

    config = {
        "train_batch_size": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    engine.save_checkpoint(str(root), tag=f"global_step{ITERATION}", client_state={"args": args})


def _logits(spec: dict, ckpt: str, tokens_path: str, out: str, port: int) -> None:
    _init(0, 1, port, 1, 1)
    from megatron.core import dist_checkpointing

    model = build_model(spec)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt)
    model.load_state_dict(loaded["model"], strict=False)
    model.eval()
    tokens = torch.load(tokens_path, weights_only=True)
    batch, length = tokens.shape
    positions = torch.arange(length).unsqueeze(0).expand(batch, -1)
    causal = torch.triu(torch.ones(length, length), 1).bool()[None, None]
    with torch.no_grad():
        logits = model(tokens, positions, causal).float()
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )
    torch.save({"logits": logits, "loss": loss}, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save")
    save.add_argument("spec")
    save.add_argument("out")
    save.add_argument("--tp", type=int, default=1)
    save.add_argument("--pp", type=int, default=1)
    save.add_argument("--formats", default="torch_dist")
    save.add_argument("--port", type=int, required=True)
    logits = sub.add_parser("logits")
    logits.add_argument("spec")
    logits.add_argument("ckpt")
    logits.add_argument("tokens")
    logits.add_argument("out")
    logits.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    if args.command == "save":
        formats = args.formats.split(",")
        mp.spawn(
            _save_rank,
            args=(spec, args.out, args.tp, args.pp, formats, args.port),
            nprocs=args.tp * args.pp,
        )
    else:
        _logits(spec, args.ckpt, args.tokens, args.out, args.port)


if __name__ == "__main__":
    main()
