"""Conversion of goodput checkpoints to and from HuggingFace Llama folders and single ``.pt`` files,
and imports of Megatron's and DeepSpeed's checkpoints (``megatron.py``, ``megatron_files.py``).

Offline and single-process: a DCP checkpoint written by any number of ranks (FSDP shards
included) is read with ``no_dist=True`` into plain CPU tensors — DCP reassembles the shards.
Model-only checkpoints are written one tensor at a time (``checkpoint.tensor_stream``: an
import never holds the whole model), in the layout of ``goodput.rundir`` with
``train_state.json`` saying ``model_only``, ``checksums.json``, and ``.complete`` last, so
``--resume`` takes them.

It lives in ``train/``, not ``checkpoint/``, because it knows the model: conversion is about
its tensor names, shapes and RoPE layout (``hf.py``, ``megatron.py``). Shapes come from
``Transformer(cfg)`` built on the meta device, so no weights are allocated for the check. Every
checkpoint read must be complete; every output is refused if it would overwrite something, and
appears only whole (HF folders by renaming a finished temp folder, checkpoints by the marker).

``.pt`` files are read with ``torch.load(weights_only=True)``: tensors and plain containers only,
never arbitrary pickled objects; Megatron's and DeepSpeed's pickles through ``pickles.py``.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from goodput.checkpoint.checksums import (
    checkpoint_files,
    file_digests,
    first_mismatch,
    read_checksums,
    write_checksums,
)
from goodput.checkpoint.load import load_tensors
from goodput.checkpoint.metadata import read_metadata
from goodput.checkpoint.tensor_stream import TensorStream
from goodput.config import load_section, to_toml
from goodput.data.tokenizer import Tokenizer, load_tokenizer
from goodput.errors import GoodputError, from_exception
from goodput.io import (
    DIR_MODE,
    atomic_path,
    fsync_dir,
    is_complete,
    is_folder,
    open_regular,
    path_status,
    read_json,
    write_json,
    write_marker,
    write_text,
)
from goodput.outputs import NEW_DIR, RUN_DIR, TORCH_FILE, check_output_dir, check_output_file
from goodput.rundir import CONFIG, LATEST, TRAIN_STATE, checkpoints_dir, step_dir
from goodput.train.config.model import ModelConfig
from goodput.train.convert import hf, megatron, megatron_files
from goodput.train.convert.hf_tokenizer import find_pinned_tokenizer, write_hf_tokenizer
from goodput.train.model import Transformer

MODEL = "model"  # the key of the model state inside a checkpoint's DCP state
HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelOnlyConfig:
    """What a model-only checkpoint's ``config.toml`` holds: the ``[model]`` table alone."""

    model: ModelConfig


def model_shapes(cfg: ModelConfig) -> Shapes:
    """Name -> (shape, dtype) of every entry of the model's state dict; allocates nothing."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def read_model_config(directory: Path) -> ModelConfig:
    return load_section(ModelConfig, directory / CONFIG, "model")


def require_complete(directory: Path) -> None:
    if not is_folder(directory):  # a loop of links is named as one
        raise GoodputError.usage(
            directory,
            "no such checkpoint directory",
            "pass a step-NNNNNNNN folder",
        )
    if not is_complete(directory):
        raise GoodputError(
            directory,
            "incomplete checkpoint (no .complete marker: the save was interrupted or failed)",
            "use a complete one; `goodput ckpt list RUN_DIR` shows which are",
        )


def require_intact(directory: Path) -> None:
    """Refuse a checkpoint whose files differ from its checksums.json (one without: a warning)."""
    digests = read_checksums(directory)
    if digests is None:
        print(f"warning: {directory} has no checksums.json; its files are not verified")
        return
    problem = first_mismatch(directory, digests)
    if problem:
        raise GoodputError(
            directory, f"refused: {problem}", "convert another checkpoint; this one is damaged"
        )


def load_model_state(
    directory: Path, cfg: ModelConfig, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The consolidated model state dict of a complete checkpoint, as plain CPU tensors in
    ``dtype`` (None: as saved). Tied embeddings come back as one tensor under both names."""
    require_complete(directory)
    require_intact(directory)
    expected = model_shapes(cfg)
    metadata = read_metadata(directory).state_dict_metadata
    prefix = MODEL + "."
    saved = {
        name[len(prefix) :]: info
        for name, info in metadata.items()
        if name.startswith(prefix) and isinstance(info, TensorStorageMetadata)
    }
    # Tied: the trainer's get_state_dict names the one tensor twice and DCP stores both; a
    # writer that dropped the duplicate is fine too. Either way only the embedding is read.
    tied_alias = "output.weight" if cfg.tie_embeddings else None
    _check_state(
        {name: (tuple(info.size), info.properties.dtype) for name, info in saved.items()},
        {name: shape for name, shape in expected.items() if name != tied_alias},
        where=directory,
        what="checkpoint",
        optional={tied_alias} if tied_alias else set(),
    )
    targets = {
        name: torch.empty(saved[name].size, dtype=dtype or saved[name].properties.dtype)
        for name in expected
        if name != tied_alias
    }
    state = {MODEL: targets}
    try:
        with _quiet_no_dist():
            load_tensors(state, directory, no_dist=True)
    except GoodputError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP wraps read failures in its own types
        raise GoodputError(
            directory,
            f"cannot read the checkpoint's tensors ({type(exc).__name__}: {exc})",
            "check that the files are intact",
        ) from None
    loaded = dict(state[MODEL])
    if tied_alias:
        loaded[tied_alias] = loaded["embedding.weight"]
    return {name: loaded[name] for name in expected}  # the model's own key order


def write_model_only_checkpoint(
    run_dir: Path, tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> Path:
    """Write ``tensors`` (name, tensor), each as it comes (``TensorStream``), as
    RUN_DIR/checkpoints/step-00000000 (model only) and point ``latest`` at it; return the
    directory. An exception from ``tensors`` removes what was written. Refuses a run directory
    that already has checkpoints: moving its ``latest`` back to step 0 would hide them."""
    root = checkpoints_dir(run_dir)
    directory = step_dir(root, 0)
    if root.is_dir() and any(root.iterdir()):
        raise GoodputError.usage(
            root,
            "already holds checkpoints",
            "write the imported checkpoint into a new OUT_DIR",
        )
    directory.mkdir(parents=True, exist_ok=True)
    stream = TensorStream(directory)
    try:
        print(f"writing {directory}", flush=True)
        for name, tensor in tensors:
            stream.add(f"{MODEL}.{name}", tensor)
        stream.finish()
        write_text(directory / CONFIG, model_config_toml(cfg))
        write_json(directory / TRAIN_STATE, {"step": 0, "model_only": True})
        digests = stream.digests()
        others = [name for name in checkpoint_files(directory) if name not in digests]
        write_checksums(directory, digests | file_digests(directory, others))
        write_marker(directory)  # last: from here on the checkpoint counts
    except BaseException:
        stream.close()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    write_text(root / LATEST, directory.name + "\n")
    return directory


def model_config_toml(cfg: ModelConfig) -> str:
    return to_toml(ModelOnlyConfig(model=cfg))


def export_hf(directory: Path, out_dir: Path, tokenizer_path: Path | None = None) -> Path:
    """A complete checkpoint as an HF ``LlamaForCausalLM`` folder (fp32 safetensors) with the
    tokenizer: ``tokenizer_path``, else the one the run pinned (``hf_tokenizer``)."""
    from safetensors.torch import save_file

    check_output_dir(out_dir, NEW_DIR, "OUT_DIR", [directory])
    require_complete(directory)
    cfg = read_model_config(directory)
    if cfg.moe is not None:
        raise GoodputError.usage(
            directory,
            "a mixture-of-experts model cannot be exported as HF Llama",
            "export dense models only; `goodput ckpt to-torch` writes MoE weights",
        )
    tokenizer = _export_tokenizer(directory, tokenizer_path, cfg)
    print(f"reading {directory}", flush=True)
    state = load_model_state(directory, cfg, torch.float32)
    print("converting to HF Llama names and RoPE layout", flush=True)
    tensors = hf.to_hf(state, cfg)
    with _whole_dir(out_dir) as temp_dir:
        print(f"writing {out_dir}", flush=True)
        save_file(tensors, str(temp_dir / HF_WEIGHTS), metadata={"format": "pt"})
        config = hf.hf_config(cfg)
        if tokenizer is not None:
            config.update(write_hf_tokenizer(tokenizer, temp_dir, cfg.max_seq_len))
        write_json(temp_dir / HF_CONFIG, config)
    return out_dir


def _export_tokenizer(
    directory: Path, tokenizer_path: Path | None, cfg: ModelConfig
) -> Tokenizer | None:
    """The tokenizer to export; None (with a warning) where the run's data pinned none."""
    found = load_tokenizer(tokenizer_path) if tokenizer_path else find_pinned_tokenizer(directory)
    if isinstance(found, GoodputError):
        print(f"warning: {found.what}; writing the weights only ({found.fix} to include one)")
        return None
    if found.vocab_size > cfg.vocab_size:
        raise GoodputError.usage(
            found.path,
            f"the tokenizer's vocabulary ({found.vocab_size}) is larger than the model's "
            f"({cfg.vocab_size})",
            "pass the tokenizer the model was trained with (--tokenizer)",
        )
    return found


def import_hf(hf_dir: Path, run_dir: Path) -> Path:
    """An HF Llama folder as a model-only goodput checkpoint under ``run_dir``. Everything read
    is checked before anything is written: config.json, every safetensors header, then the
    tensors' names, shapes and values against the config."""
    check_output_dir(run_dir, RUN_DIR, "OUT_DIR", [hf_dir])
    config_path = hf_dir / HF_CONFIG
    if path_status(config_path) is None:  # a folder or a FIFO: read_json names it
        raise GoodputError.usage(
            config_path,
            "not found",
            "pass an HF model folder holding config.json",
        )
    cfg = hf.model_config(read_json(config_path), str(config_path))
    print(f"reading {hf_dir}", flush=True)
    tensors = _read_safetensors(hf_dir, cfg)
    # Upcast to the fp32 the trainer keeps its weights in (exact for bf16/fp16 inputs).
    state = hf.from_hf(tensors, cfg, str(hf_dir))
    state = {name: t.float() if t.is_floating_point() else t for name, t in state.items()}
    return _write_checked(state, cfg, run_dir, hf_dir, "HF folder")


def import_megatron(source_dir: Path, kind: str, config: Path, run_dir: Path) -> Path:
    """A Megatron-core (torch_dist), Megatron-LM legacy or DeepSpeed checkpoint of a GPT as a
    model-only checkpoint under ``run_dir``, in the shape of ``config``'s ``[model]``. The
    source's saved args are checked against that config before a tensor is read; tensors are
    read one at a time (``megatron_files``)."""
    check_output_dir(run_dir, RUN_DIR, "--output", [source_dir, config])
    cfg = load_section(ModelConfig, config, "model")
    if cfg.moe is not None:
        raise GoodputError.usage(
            f"{config} [model.moe]",
            "mixture-of-experts models are not imported from Megatron yet",
            "import a dense model",
        )
    print(f"reading {source_dir} ({kind})", flush=True)
    found = megatron_files.source(source_dir, kind, cfg)
    if found.args is None:
        print(f"warning: {found.where} holds no Megatron args; checking tensor shapes only")
    else:
        megatron.check_args(found.args, cfg, found.where, str(config))
    interleaved = found.args is not None and found.args.get("rotary_interleaved") is True
    _refuse_unused(found, cfg)
    print("optimizer: starts fresh (the source's optimizer state is not imported)", flush=True)
    tensors = megatron.goodput_tensors(found.tensor, cfg, interleaved)
    return write_model_only_checkpoint(run_dir, _checked(tensors, cfg, source_dir), cfg)


def _refuse_unused(found: megatron_files.Source, cfg: ModelConfig) -> None:
    """Refuse a source holding tensors this [model] has no place for (a bias, a layer more),
    before anything is read: every one the import will read is in ``megatron.goodput_tensors``."""
    needed: set[tuple[str, int | None]] = {(megatron.EMBEDDING, None), (megatron.FINAL_NORM, None)}
    needed |= {(name, i) for name in megatron.LAYER_TENSORS for i in range(cfg.num_layers)}
    if not cfg.tie_embeddings:
        needed.add((megatron.OUTPUT, None))
    unused = sorted(
        (name, -1 if layer is None else layer)
        for name, layer in found.names - needed
        if not (cfg.tie_embeddings and name == megatron.OUTPUT)  # the last stage's copy
    )
    if unused:
        name, layer = unused[0]
        what = name if layer < 0 else f"{megatron.LAYERS}{layer}.{name}"
        raise GoodputError.usage(
            found.where,
            f"holds '{what}', which goodput's Llama with this [model] has no place for",
            "pass the [model] config the checkpoint was trained with (layers, tied head)",
        )


def _checked(
    tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, source: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors``, each checked as it comes against the model's shape and for finite values."""
    expected = model_shapes(cfg)
    for name, tensor in tensors:
        shape = expected[name][0]
        if tuple(tensor.shape) != shape:
            raise GoodputError.usage(
                source,
                f"'{name}' has shape {list(tensor.shape)} in the checkpoint, the [model] config "
                f"needs {list(shape)}",
                "pass the [model] config these weights were trained with",
            )
        _require_finite(tensor, name, source)
        yield name, tensor


def to_torch(directory: Path, file: Path) -> Path:
    """The consolidated model state dict of a complete checkpoint as one ``torch.save`` file
    of plain tensors (dtypes as saved)."""
    check_output_file(file, TORCH_FILE, "FILE", [directory])
    require_complete(directory)
    cfg = read_model_config(directory)
    print(f"reading {directory}", flush=True)
    state = load_model_state(directory, cfg)
    print(f"writing {file}", flush=True)
    with atomic_path(file) as tmp:
        torch.save(state, tmp)
    return file


def from_torch(file: Path, config: Path, run_dir: Path) -> Path:
    """A ``.pt`` state dict plus a TOML ``[model]`` table as a model-only checkpoint."""
    check_output_dir(run_dir, RUN_DIR, "OUT_DIR", [file, config])
    cfg = load_section(ModelConfig, config, "model")
    print(f"reading {file}", flush=True)
    try:
        # Opened here, a regular file only: torch.load would wait on a FIFO forever.
        with open_regular(file) as stream:
            loaded = torch.load(stream, map_location="cpu", weights_only=True)
    except GoodputError as exc:  # missing, unreadable or not a regular file: a bad argument
        raise GoodputError.usage(exc.where, exc.what, exc.fix) from None
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise GoodputError(
            file,
            f"not a plain tensor file ({' '.join(str(exc).split())[:200]})",
            "save a dict of tensors (model.state_dict()); other pickled objects are refused",
        ) from None
    state = _state_dict_in(loaded, file)
    tied = cfg.tie_embeddings and "embedding.weight" in state
    if (
        tied
        and "output.weight" in state
        and not torch.equal(state["output.weight"], state["embedding.weight"])
    ):
        raise GoodputError.usage(
            file,
            "output.weight differs from embedding.weight, but the config ties them",
            "set tie_embeddings = false in [model]",
        )
    if tied:
        state["output.weight"] = state["embedding.weight"]
    state = {name: t.float() if t.is_floating_point() else t for name, t in state.items()}
    return _write_checked(state, cfg, run_dir, file, "file")


def _write_checked(
    state: dict[str, torch.Tensor], cfg: ModelConfig, run_dir: Path, source: Path, what: str
) -> Path:
    expected = model_shapes(cfg)
    _check_state(
        {name: (tuple(t.shape), t.dtype) for name, t in state.items()},
        expected,
        where=source,
        what=what,
    )
    for name in expected:
        _require_finite(state[name], name, source)
    return write_model_only_checkpoint(run_dir, ((name, state[name]) for name in expected), cfg)


def _require_finite(tensor: torch.Tensor, name: str, source: Path) -> None:
    # fp64 beyond fp32's range arrives here as inf; a damaged file may hold NaN. The least and
    # greatest values are NaN if any is, and infinite if any is: one pass with no mask of the
    # tensor's size (14x faster than isfinite(t).all() on this machine).
    if tensor.numel() and not all(math.isfinite(v.item()) for v in torch.aminmax(tensor)):
        raise GoodputError(
            source,
            f"'{name}' holds NaN or infinite values",
            "import weights that are finite in fp32",
        )


def _check_state(
    found: Shapes, expected: Shapes, *, where: Path, what: str, optional: set[str] | None = None
) -> None:
    """Same names and shapes as the model (dtypes may differ); name the first difference."""
    optional = optional or set()
    fix = "pass the [model] config these weights were trained with"
    for name, (shape, _dtype) in expected.items():
        if name not in found:
            raise GoodputError.usage(
                where,
                f"the {what} has no '{name}', which the [model] config needs",
                fix,
            )
        if found[name][0] != shape:
            raise GoodputError.usage(
                where,
                f"'{name}' has shape {list(found[name][0])} in the {what}, the [model] config "
                f"needs {list(shape)}",
                fix,
            )
    for name in found:
        if name not in expected and name not in optional:
            raise GoodputError.usage(
                where,
                f"the {what} has '{name}', which the [model] config does not",
                fix,
            )


def _state_dict_in(loaded: object, file: Path) -> dict[str, torch.Tensor]:
    """The tensor dict in a loaded ``.pt``: the top level, or a single nested ``model`` or
    ``state_dict`` entry (how training scripts often save)."""
    if isinstance(loaded, dict):
        for key in ("model", "state_dict"):
            if isinstance(loaded.get(key), dict):
                loaded = loaded[key]
                break
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and _is_weight(v) for k, v in loaded.items()
    ):
        raise GoodputError.usage(
            file,
            "does not hold a dict of name -> dense floating-point tensor",
            "save model.state_dict() (optionally under a 'model' key)",
        )
    return dict(loaded)


def _is_weight(value: object) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and value.is_floating_point()
    )


def _read_safetensors(hf_dir: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files; all headers are checked first, and
    every tensor's name and shape against ``cfg``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = _safetensors_files(hf_dir)
    expected = {name: shape for name, (shape, _dtype) in model_shapes(cfg).items()}
    for path in files:
        hf.check_hf_shapes(_check_safetensors_header(path), expected, str(path))
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        print(f"reading {path}", flush=True)
        try:
            loaded = load_file(str(path), device="cpu")
        except SafetensorError as exc:  # what our header check does not look at
            raise GoodputError(
                path, f"unreadable safetensors ({exc})", "download it again"
            ) from None
        twice = sorted(tensors.keys() & loaded.keys())
        if twice:
            raise GoodputError.usage(
                path, f"holds '{twice[0]}' again", "remove the duplicate from one of the files"
            )
        tensors.update(loaded)
    return tensors


def _safetensors_files(hf_dir: Path) -> list[Path]:
    """The weight files of an HF folder: those its index names, else model.safetensors. An
    index may name plain file names in the folder only."""
    index = hf_dir / HF_INDEX
    if not index.is_file():
        if (hf_dir / HF_WEIGHTS).is_file():
            return [hf_dir / HF_WEIGHTS]
        raise GoodputError.usage(
            hf_dir,
            f"no {HF_WEIGHTS} or {HF_INDEX}",
            "pass a folder with safetensors weights (convert .bin weights with transformers)",
        )
    contents = read_json(index)
    weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and _is_file_name(name) for name in weight_map.values()
    ):
        raise GoodputError(
            index,
            "has no weight_map of tensor name -> file name in this folder",
            "restore the index that came with the weights",
        )
    return [hf_dir / name for name in sorted(set(weight_map.values()))]


def _is_file_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _check_safetensors_header(path: Path) -> dict[str, list[int]]:
    """The tensor shapes of ``path``'s header, once the header is checked."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            length = hf.safetensors_header_length(f.read(8), size, str(path))
            return hf.check_safetensors_header(f.read(length), size - 8 - length, str(path))
    except OSError as exc:
        raise from_exception(exc) from None


@contextmanager
def _whole_dir(out_dir: Path) -> Iterator[Path]:
    """A temp folder beside ``out_dir``, renamed onto it once the body finished: readers see no
    folder or a whole one."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield temp_dir
        for path in temp_dir.iterdir():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(temp_dir, DIR_MODE)
        os.rename(temp_dir, out_dir)  # replaces an empty out_dir (checked before), nothing else
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise


@contextmanager
def _quiet_no_dist() -> Iterator[None]:
    # DCP warns that no process group exists; here that is the point, not a mistake.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield
