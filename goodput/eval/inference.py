"""A checkpoint's model and tokenizer for inference (``goodput generate``, ``goodput eval``):
whole in one process, or sharded over the ranks of a ``goodput launch``.

Owns ``resolve_checkpoint`` (a step directory, or a run directory's newest complete one),
``inference_dtype``, ``joined_ranks`` (the launch's process group, set up as the trainer sets it
up and torn down after), ``load_for_inference`` and its ``Loaded``.

Finding it. ``CHECKPOINT`` is a ``step-N`` directory or a run directory, whose newest complete,
undamaged checkpoint is taken as ``--resume auto`` takes it (``checkpoint.load.find_checkpoint``).
The tokenizer is ``--tokenizer`` if given, else the one the run's blend pins
(``train.hf_tokenizer.pinned_tokenizer``: its path and sha256, a moved or changed file refused
with the fix, pass --tokenizer); one larger than the model's vocabulary is refused.

Dtype. The weights are held, and the matmuls run, in the compute dtype of the checkpoint's
precision policy (its ``config.toml``'s ``[parallel] precision``, ``train.parallelize
.compute_dtype``): ``fp32`` stays fp32; ``fp32-master`` and ``pure-bf16`` run in bf16 (half the
memory of fp32) on every device, CPU included: the dtype the trainer computed in. On a CPU bf16
is correct and slower than fp32 unless the CPU has bf16 instructions. A model-only checkpoint
(``goodput ckpt import``: no ``[parallel]``) runs in the dtype its weights were saved in.
The rotary frequencies (a buffer no checkpoint holds) stay fp32 in every policy; logits are
read as fp32 by every caller.

One process (no launch): the whole model on this process's device, read by
``train.convert.load_model_state`` (complete, checksummed, no process group).

Sharded. Under ``goodput launch`` (or torchrun, srun, mpiexec: any placement of more than one
rank), each rank joins the process group as the trainer does (``train.setup.setup_torch``) and
builds the trainer's mesh (``train.mesh.build_mesh``) with every rank a ``dp_shard`` rank; the
model is built on the meta device, laid out by the trainer's ``parallelize`` (FSDP over all
ranks), and only this rank's shards are allocated and read, by DCP
(``checkpoint.load.load_model_weights``). The checksums are hashed meanwhile, the files split over
the ranks (``checkpoint.verify``); a mismatch is refused on every rank. Per rank that holds the
checkpoint's state / world size, plus one block (and the root's embedding and output head)
gathered at a time.

Every rank then computes the same thing (FSDP gathers each block's weights for its forward, so a
forward is a collective: the ranks run the same forwards, in step); rank 0 alone prints and
writes. Results equal one process's bit for bit (on the same kind of device): the all-gather
rebuilds the very weights, and the matmuls are the same.

It does not split matmuls (``tp``), sequences (``cp``), experts (``ep``) or layers (``pp``) for
inference: tensor parallelism's sequence-parallel plan needs every sequence a multiple of
``tp`` long, which a KV cache's one new token is not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from goodput.checkpoint.load import find_checkpoint, load_model_weights
from goodput.checkpoint.metadata import read_metadata
from goodput.checkpoint.verify import PendingVerification
from goodput.config import from_table, read_toml
from goodput.data.tokenizer import Tokenizer, load_tokenizer
from goodput.errors import GoodputError
from goodput.io import is_folder
from goodput.launch.env import current_placement
from goodput.rundir import CONFIG, STEP_DIR, checkpoints_dir
from goodput.train.config.model import ModelConfig
from goodput.train.config.parallel import ParallelConfig
from goodput.train.convert.checkpoints import (
    MODEL,
    load_model_state,
    read_model_config,
    require_complete,
)
from goodput.train.convert.hf_tokenizer import pinned_tokenizer
from goodput.train.device import detect_device_type, local_device
from goodput.train.model import Transformer
from goodput.train.parallel.mesh import build_mesh
from goodput.train.parallel.parallelize import compute_dtype, parallelize
from goodput.train.setup import Runtime, setup_torch


@dataclass(frozen=True, slots=True)
class Loaded:
    directory: Path  # the checkpoint directory the model came from
    model: Transformer  # in eval mode, on the device asked for; sharded over the ranks if any
    tokenizer: Tokenizer


@contextlib.contextmanager
def joined_ranks() -> Iterator[Runtime | None]:
    """This rank of a launch of several (the process group, joined as the trainer joins it, is
    destroyed on exit if joined here); None in a process of its own."""
    if current_placement().world_size == 1 and not dist.is_initialized():
        yield None
        return
    joined = not dist.is_initialized()
    try:
        runtime = setup_torch()
        yield runtime if runtime.world_size > 1 else None
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()


def is_rank_zero() -> bool:
    """Whether this process reports: the one process, or rank 0 of a launch."""
    return not dist.is_initialized() or dist.get_rank() == 0


def load_for_inference(path: Path, tokenizer_path: Path | None, runtime: Runtime | None) -> Loaded:
    """The model of a checkpoint or run directory (see ``resolve_checkpoint``) and its
    tokenizer (see the module docstring): whole on this process's device when ``runtime`` is
    None, else sharded over its ranks."""
    directory = resolve_checkpoint(path)
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else pinned_tokenizer(directory)
    cfg = read_model_config(directory)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise GoodputError.usage(
            tokenizer.path,
            f"the tokenizer's vocabulary ({tokenizer.vocab_size}) is larger than the "
            f"model's ({cfg.vocab_size})",
            "pass the tokenizer the model was trained with (--tokenizer)",
        )
    dtype = inference_dtype(directory)
    if runtime is None:
        device = local_device(detect_device_type(), current_placement().local_rank)
        return Loaded(directory, load_model(directory, cfg, device, dtype), tokenizer)
    return Loaded(directory, load_sharded(directory, cfg, runtime, dtype), tokenizer)


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory as it is; a run directory's newest complete, undamaged one."""
    if not is_folder(path):  # a loop of links is named as one, not as missing
        raise GoodputError.usage(
            path,
            "no such checkpoint or run directory",
            "pass RUN/checkpoints/step-N or a run directory",
        )
    root = checkpoints_dir(path)
    if is_folder(root):
        directory = find_checkpoint(root, "auto")
        if directory is None:
            raise GoodputError.usage(
                path,
                "has no complete checkpoint",
                "`goodput ckpt list RUN_DIR` shows its checkpoints; pass one that is complete",
            )
        return directory
    if not STEP_DIR.fullmatch(path.name):
        raise GoodputError.usage(
            path,
            "is neither a checkpoint directory (step-N) nor a run directory (with checkpoints/)",
            "pass RUN/checkpoints/step-N or a run directory",
        )
    require_complete(path)
    return path


def inference_dtype(directory: Path) -> torch.dtype:
    """The compute dtype of the checkpoint's precision policy; for a model-only checkpoint,
    the dtype its embedding was saved in (see the module docstring)."""
    path = directory / CONFIG
    table = read_toml(path).get("parallel")
    if isinstance(table, dict):
        return compute_dtype(from_table(ParallelConfig, table, str(path), "parallel."))
    saved = read_metadata(directory).state_dict_metadata.get(f"{MODEL}.embedding.weight")
    if not isinstance(saved, TensorStorageMetadata):
        raise GoodputError(
            directory, "holds no model.embedding.weight tensor", "use a checkpoint goodput wrote"
        )
    return saved.properties.dtype


def load_model(
    directory: Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> Transformer:
    """The whole model of a complete, intact checkpoint on ``device`` in ``dtype``, in eval
    mode."""
    state = load_model_state(directory, cfg, dtype)
    model = _empty_model(cfg, dtype)
    model.allocate(device)
    model.load_state_dict(state)
    return model.eval()


def load_sharded(
    directory: Path, cfg: ModelConfig, runtime: Runtime, dtype: torch.dtype
) -> Transformer:
    """Collective: this rank's shards of the checkpoint's model (see the module docstring)."""
    verification = PendingVerification(directory)  # hashes while the model is laid out
    # fp32 here is the parallelize's precision policy of a model already cast to ``dtype``:
    # FSDP then gathers and computes in the weights' own dtype, casting nothing.
    layout = ParallelConfig(precision="fp32")
    mesh = build_mesh(layout, runtime.device, runtime.ranks_per_host)
    model = parallelize(_empty_model(cfg, dtype), layout, mesh)
    assert isinstance(model, Transformer)
    model.allocate(runtime.device)
    verdict = verification.result()
    if verdict.problem is not None:
        raise GoodputError(
            directory, f"refused: {verdict.problem}", "evaluate another checkpoint; this is damaged"
        )
    if not verdict.checksummed and is_rank_zero():
        print(f"warning: {directory} has no checksums.json; its files are not verified")
    load_model_weights(directory, [model])
    return model.eval()


def _empty_model(cfg: ModelConfig, dtype: torch.dtype) -> Transformer:
    """The model on the meta device, its parameters in ``dtype``; its buffers (the rotary
    frequencies) fp32."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to(dtype)
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.float())
    return model
