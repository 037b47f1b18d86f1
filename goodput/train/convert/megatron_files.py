"""Megatron's and DeepSpeed's checkpoint folders, read one whole tensor at a time in Megatron's
names (``megatron``): ``source(path, kind, cfg)`` gives a ``Source`` whose ``tensor(name,
layer)`` reads only the pieces of that one tensor, its size checked against ``cfg`` first.

- ``megatron`` (Megatron-core ``torch_dist``): a DCP folder whose layers are stacked
  (``decoder.layers.<name>`` is [num_layers, ...]) and whose tensors are whole in any source
  layout; the chunks of one layer are read, each checked against the metadata. The
  ``.metadata`` goes through goodput's allow-list reader, ``common.pt`` (Megatron-LM's args)
  through ``pickles``.
- ``megatron-legacy`` (Megatron-LM / Megatron-DeepSpeed): ``iter_NNNNNNN/mp_rank_TT[_PPP]/
  model_optim_rng.pt``, one pickle per TP x PP rank holding that rank's cut of its stage's
  layers (numbered from 0 on every stage); the cuts are joined along each tensor's TP
  dimension and the layers renumbered by stage.
- ``deepspeed``: ``global_stepN/mp_rank_TT_model_states.pt``, whose ``module`` is the model's
  state dict on that TP rank (ZeRO stages 0-2 keep it whole there); joined as above.

A folder may be given as the checkpoint root (Megatron's ``latest_checkpointed_iteration.txt``
or DeepSpeed's ``latest`` then picks the step) or as the step's folder itself.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from goodput.checkpoint.metadata import read_metadata
from goodput.errors import GoodputError
from goodput.io import is_folder, open_regular, path_status, read_json, read_text
from goodput.train.config.model import ModelConfig
from goodput.train.convert import megatron
from goodput.train.convert.pickles import load_torch_file

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
DEEPSPEED_TRACKER = "latest"
_ITERATION = re.compile(r"[0-9]{1,12}")  # ASCII digits only: str.isdigit takes "¹"
_LEGACY_RANK = re.compile(r"mp_rank_([0-9]{2})(?:_([0-9]{3}))?")
_DEEPSPEED_RANK = re.compile(r"mp_rank_([0-9]{2})_model_states\.pt")
_TAG = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_LAYER_NAME = re.compile(r"decoder\.layers\.([0-9]{1,6})\.(.+)")


@dataclass
class Source:
    """A checkpoint of Megatron's GPT: its saved args (None where it has none), the names of
    its model tensors, and ``tensor(name, layer)`` reading one of them whole."""

    where: str
    args: dict[str, Any] | None
    names: set[tuple[str, int | None]]
    read: Callable[[str, int | None, tuple[int, ...]], torch.Tensor]
    shapes: dict[str, tuple[int, ...]]

    def tensor(self, name: str, layer: int | None) -> torch.Tensor:
        """The whole tensor, its shape checked against the [model] config's before it is
        allocated (a source's sizes are not trusted)."""
        if (name, layer) not in self.names:
            raise GoodputError.usage(
                self.where,
                f"has no '{_full_name(name, layer)}', which the [model] config needs",
                "pass the [model] config this checkpoint was trained with",
            )
        return self.read(name, layer, self.shapes[name])


def _full_name(name: str, layer: int | None) -> str:
    return name if layer is None else f"{megatron.LAYERS}{layer}.{name}"


def _wrong_shape(where: Path, key: str, found: Any, shape: tuple[int, ...]) -> GoodputError:
    return GoodputError.usage(
        where,
        f"'{key}' is {list(found)} in the checkpoint, the [model] config needs {list(shape)}",
        "pass the [model] config this checkpoint was trained with",
    )


def source(path: Path, kind: str, cfg: ModelConfig) -> Source:
    if kind == "megatron":
        return _torch_dist(_step_dir(path, MEGATRON_TRACKER, _megatron_step), cfg)
    if kind == "megatron-legacy":
        return _legacy(_step_dir(path, MEGATRON_TRACKER, _megatron_step), cfg)
    return _deepspeed(_step_dir(path, DEEPSPEED_TRACKER, _deepspeed_step), cfg)


def _step_dir(path: Path, tracker: str, step: Callable[[Path, str], Path]) -> Path:
    if not is_folder(path):  # a loop of links is named as one
        raise GoodputError.usage(path, "no such checkpoint folder", "pass the checkpoint folder")
    marker = path / tracker
    return step(path, read_text(marker, 4096).strip()) if path_status(marker) else path


def _megatron_step(root: Path, text: str) -> Path:
    where = root / MEGATRON_TRACKER
    if text == "release":
        return root / "release"
    if not _ITERATION.fullmatch(text):
        raise GoodputError(where, f"holds {text[:40]!r}, not an iteration", "write the number")
    return root / f"iter_{int(text):07d}"


def _deepspeed_step(root: Path, text: str) -> Path:
    if not _TAG.fullmatch(text) or text in (".", ".."):
        raise GoodputError(
            root / DEEPSPEED_TRACKER,
            f"holds {text[:40]!r}, not a tag",
            "write the tag's folder name",
        )
    return root / text


def _torch_dist(directory: Path, cfg: ModelConfig) -> Source:
    info = (
        read_json(directory / "metadata.json", 1 << 16)
        if (directory / "metadata.json").exists()
        else {}
    )
    backend = info.get("sharded_backend", "torch_dist") if isinstance(info, dict) else None
    if backend != "torch_dist":
        raise GoodputError.usage(
            directory / "metadata.json",
            f"sharded_backend is {backend!r}; goodput reads torch_dist",
            "re-save with Megatron's --ckpt-format torch_dist",
        )
    metadata = read_metadata(directory)
    common = directory / "common.pt"
    args = (
        megatron.args_dict(_dict_of(load_torch_file(common), common).get("args"))
        if common.exists()
        else None
    )
    tensors = {
        key: entry
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata) and _is_model_key(key)
    }
    names: set[tuple[str, int | None]] = set()
    for key, entry in tensors.items():
        if key.startswith(megatron.LAYERS):
            if len(entry.size) < 1 or entry.size[0] != cfg.num_layers:
                raise GoodputError.usage(
                    directory,
                    f"'{key}' stacks {list(entry.size)[:1]} layers, the [model] config has "
                    f"{cfg.num_layers}",
                    "pass the [model] config this checkpoint was trained with",
                )
            names.update((key[len(megatron.LAYERS) :], i) for i in range(cfg.num_layers))
        else:
            names.add((key, None))
    last: dict[tuple[str, int], torch.Tensor] = {}  # one chunk read stays: the next may share it

    def read(name: str, layer: int | None, shape: tuple[int, ...]) -> torch.Tensor:
        key = name if layer is None else megatron.LAYERS + name
        entry = tensors[key]
        size = entry.size if layer is None else entry.size[1:]
        if tuple(size) != shape:
            raise _wrong_shape(directory, key, size, shape)
        whole = torch.empty(size, dtype=entry.properties.dtype)
        covered = 0
        for chunk in entry.chunks:
            offsets, sizes = list(chunk.offsets), list(chunk.sizes)
            if len(offsets) != len(entry.size) or any(
                start + length > bound
                for start, length, bound in zip(offsets, sizes, entry.size, strict=False)
            ):
                raise GoodputError(
                    directory, f"a chunk of '{key}' lies outside it", "pass an intact checkpoint"
                )
            if layer is not None:
                if not offsets[0] <= layer < offsets[0] + sizes[0]:
                    continue
                first = layer - offsets[0]
                offsets, sizes = offsets[1:], sizes[1:]
            data = _chunk(directory, metadata, key, chunk, entry, last)
            if layer is not None:
                data = data[first]
            target = whole
            for dim, (start, length) in enumerate(zip(offsets, sizes, strict=True)):
                target = target.narrow(dim, start, length)
            target.copy_(data)
            covered += data.numel()
        if covered != whole.numel():
            raise GoodputError(
                directory,
                f"the chunks of '{key}' cover {covered} of its {whole.numel()} values",
                "pass a complete checkpoint; this one is damaged",
            )
        return whole

    return Source(str(directory), args, names, read, megatron.shapes(cfg))


def _chunk(
    directory: Path,
    metadata: Any,
    key: str,
    chunk: Any,
    entry: TensorStorageMetadata,
    last: dict[tuple[str, int], torch.Tensor],
) -> torch.Tensor:
    """One saved chunk of ``key``, checked against the metadata's shape and dtype."""
    info = metadata.storage_data.get(MetadataIndex(fqn=key, offset=chunk.offsets))
    if info is None:
        raise GoodputError(
            directory, f"'{key}' names a chunk that is not stored", "pass a complete checkpoint"
        )
    cache_key = (info.relative_path, info.offset)
    if cache_key in last:
        return last[cache_key]
    if info.transform_descriptors:
        raise GoodputError.usage(
            directory,
            f"'{key}' is stored transformed ({info.transform_descriptors})",
            "save it uncompressed",
        )
    path = directory / info.relative_path
    with open_regular(path) as f:
        if info.offset + info.length > os.fstat(f.fileno()).st_size:
            raise GoodputError(
                path, f"is shorter than the chunk of '{key}' it holds", "pass a complete checkpoint"
            )
        f.seek(info.offset)
        data = f.read(info.length)
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torn or hostile bytes: refused by the weights-only reader
        raise GoodputError(
            path,
            f"the chunk of '{key}' is unreadable ({type(exc).__name__})",
            "pass an intact checkpoint",
        ) from None
    if (
        not isinstance(tensor, torch.Tensor)
        or list(tensor.shape) != list(chunk.sizes)
        or tensor.dtype != entry.properties.dtype
    ):
        raise GoodputError(
            path,
            f"the chunk of '{key}' is not the {list(chunk.sizes)} tensor the metadata says",
            "pass an intact checkpoint",
        )
    last.clear()
    last[cache_key] = tensor
    return tensor


def _is_model_key(key: str) -> bool:
    return key.split(".")[0] in ("embedding", "decoder", "output_layer") and not key.endswith(
        "_extra_state"
    )


def _dict_of(loaded: Any, path: Path) -> dict[str, Any]:
    if not isinstance(loaded, dict):
        raise GoodputError(
            path, f"holds a {type(loaded).__name__}, not a dict", "pass the checkpoint's own file"
        )
    return loaded


def _legacy(directory: Path, cfg: ModelConfig) -> Source:
    ranks: dict[tuple[int, int], Path] = {}
    for child in sorted(directory.iterdir()) if directory.is_dir() else []:
        match = _LEGACY_RANK.fullmatch(child.name)
        if match:
            ranks[int(match.group(1)), int(match.group(2) or 0)] = child / "model_optim_rng.pt"
    if not ranks:
        raise GoodputError.usage(
            directory,
            "holds no mp_rank_TT[_PPP]/model_optim_rng.pt",
            "pass a Megatron-LM checkpoint folder (or its iter_NNNNNNN folder)",
        )
    states, args = {}, None
    for (tp, pp), path in ranks.items():
        loaded = _dict_of(load_torch_file(path), path)
        if "model" not in loaded:
            found = (
                "model0 (virtual pipeline stages: not imported yet)"
                if "model0" in loaded
                else "no 'model'"
            )
            raise GoodputError.usage(
                path, f"holds {found}", "pass a checkpoint saved without virtual pipeline stages"
            )
        states[tp, pp] = _dict_of(loaded["model"], path)
        args = args or megatron.args_dict(loaded.get("args"))
    return _joined(directory, states, args, cfg)


def _deepspeed(directory: Path, cfg: ModelConfig) -> Source:
    if (directory / "zero").is_dir():
        raise GoodputError.usage(
            directory,
            "is a DeepSpeed universal checkpoint, which goodput does not import yet",
            "pass the global_stepN folder DeepSpeed's save_checkpoint wrote",
        )
    states, args = {}, None
    for child in sorted(directory.iterdir()) if directory.is_dir() else []:
        match = _DEEPSPEED_RANK.fullmatch(child.name)
        if match is None:
            if child.name.startswith("layer_"):
                raise GoodputError.usage(
                    directory,
                    "holds DeepSpeed pipeline-module layers (layer_*), not imported yet",
                    "save without DeepSpeed's PipelineModule, or convert with Megatron-DeepSpeed",
                )
            continue
        loaded = _dict_of(load_torch_file(child), child)
        stage = _zero_stage(loaded)
        if stage == 3:
            raise GoodputError.usage(
                child,
                "is a ZeRO-3 checkpoint (its weights live in the optimizer partitions), not "
                "imported yet",
                "save with ZeRO stage 0-2, or run DeepSpeed's ds_to_universal and wait for it",
            )
        module = _dict_of(loaded.get("module"), child)
        if module and all(isinstance(key, str) and key.startswith("module.") for key in module):
            module = {key[len("module.") :]: value for key, value in module.items()}  # a wrapper's
        states[int(match.group(1)), 0] = module
        args = args or megatron.args_dict(loaded.get("args"))
    if not states:
        raise GoodputError.usage(
            directory, "holds no mp_rank_TT_model_states.pt", "pass a DeepSpeed global_stepN folder"
        )
    return _joined(directory, states, args, cfg)


def _zero_stage(loaded: dict[str, Any]) -> int:
    config = loaded.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    return stage if isinstance(stage, int) else 0


def _joined(
    directory: Path,
    states: dict[tuple[int, int], dict[str, Any]],
    args: dict[str, Any] | None,
    cfg: ModelConfig,
) -> Source:
    """One Source over the TP x PP rank state dicts: each tensor joined from its TP cuts, each
    layer numbered by its stage's place."""
    tp_size = 1 + max(tp for tp, _ in states)
    pp_size = 1 + max(pp for _, pp in states)
    missing = [(tp, pp) for tp in range(tp_size) for pp in range(pp_size) if (tp, pp) not in states]
    if missing:
        raise GoodputError.usage(
            directory,
            f"has no file of TP rank {missing[0][0]}, PP rank {missing[0][1]}",
            "pass the complete checkpoint",
        )
    local: dict[int, dict[tuple[str, int | None], str]] = {}  # stage -> (name, local layer) -> key
    for pp in range(pp_size):
        local[pp] = {}
        for key, value in states[0, pp].items():
            if not isinstance(key, str) or key.endswith("_extra_state") or value is None:
                continue
            if key.startswith("language_model."):
                raise GoodputError.usage(
                    directory,
                    f"names its tensors as Megatron's models before megatron-core did ('{key}'), "
                    "which goodput does not import yet",
                    "convert it to a megatron-core checkpoint with Megatron's own tools first",
                )
            match = _LAYER_NAME.fullmatch(key)
            if match:
                name = megatron.LOCAL_NAMES.get(match.group(2), match.group(2))
                local[pp][name, int(match.group(1))] = key
            else:
                local[pp][key, None] = key
    place: dict[tuple[str, int | None], tuple[int, str]] = {}  # (name, global layer) -> stage, key
    offset = 0
    for pp in range(pp_size):
        layers = {layer for _, layer in local[pp] if layer is not None}
        if layers != set(range(len(layers))):
            raise GoodputError(
                directory,
                f"stage {pp}'s layers are not numbered 0..{len(layers) - 1}",
                "pass the complete checkpoint",
            )
        for (name, layer), key in local[pp].items():
            place[name, None if layer is None else offset + layer] = (pp, key)
        offset += len(layers)

    def read(name: str, layer: int | None, shape: tuple[int, ...]) -> torch.Tensor:
        pp, key = place[name, layer]
        dim = megatron.TP_DIM[name]
        cut = (
            shape
            if dim is None
            else tuple(size // tp_size if d == dim else size for d, size in enumerate(shape))
        )
        shards = []
        for tp in range(tp_size):
            shard = states[tp, pp].get(key)
            if not isinstance(shard, torch.Tensor) or not shard.is_floating_point():
                raise GoodputError(
                    directory,
                    f"TP rank {tp}, PP rank {pp} has no tensor '{key}'",
                    "pass the complete checkpoint",
                )
            if tuple(shard.shape) != cut or (dim is not None and shape[dim] % tp_size):
                raise _wrong_shape(directory, f"{key} of TP rank {tp}", shard.shape, cut)
            shards.append(shard)
        if dim is None or tp_size == 1:
            return shards[0]
        if name == megatron.FC1:
            return megatron.merge_fc1(shards)
        return torch.cat(shards, dim=dim)

    return Source(str(directory), args, set(place), read, megatron.shapes(cfg))
