"""The one reader of a checkpoint's DCP ``.metadata``, which is a pickle.

torch's ``FileSystemReader.read_metadata`` unpickles that file without restriction, so a crafted
``.metadata`` in a shared or downloaded run folder would run its author's code on resume. Here
the unpickler resolves only the classes DCP's metadata is made of (``ALLOWED``, plus torch
dtypes); any other global (``os.system``, ``builtins.eval``, a dotted path through an allowed
class) is refused before it is looked up, so nothing outside the list is ever called. The
result is then checked as data: every tensor's size, every storage entry's file name (a plain
``__R_N.distcp`` in the checkpoint folder, never a path elsewhere) and byte range.

``MetadataReader`` hands DCP the metadata read here, so ``dcp.load`` never unpickles it again.
Every read of ``.metadata`` in goodput goes through ``read_metadata``.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

from goodput.errors import GoodputError
from goodput.io import read_bytes
from goodput.rundir import METADATA

MAX_METADATA_BYTES = 1 << 30  # ~100x the metadata of a 405B model saved by 16k ranks
DCP_FILE = re.compile(r"__\d{1,9}_\d{1,9}\.distcp")
MAX_DIM = 1 << 48

ALLOWED = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # a name -> torch.layout lookup
        ("torch", "Size"),
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        # Megatron-core's torch_dist keeps every rank's save plan in the metadata
        # (all_local_plans): plain dataclasses and an enum, read as data and never used.
        ("torch.distributed.checkpoint.planner", "SavePlan"),
        ("torch.distributed.checkpoint.planner", "WriteItem"),
        ("torch.distributed.checkpoint.planner", "WriteItemType"),
        ("torch.distributed.checkpoint.planner", "TensorWriteData"),
        ("torch.distributed.checkpoint.planner", "BytesIOWriteData"),
    }
)


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: not checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id: not checkpoint metadata")


def read_metadata(directory: Path) -> Metadata:
    """The DCP metadata of the checkpoint ``directory``, or a ``GoodputError`` naming the
    file: unreadable, too big, a payload that is not metadata, or entries that do not add up."""
    path = directory / METADATA
    data = read_bytes(path, MAX_METADATA_BYTES)
    try:
        metadata = _AllowListUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # a hostile or torn pickle fails in many ways; each is a refusal
        raise _refused(path, f"{type(exc).__name__}: {exc}") from None
    _check(metadata, path)
    return metadata


class MetadataReader(FileSystemReader):
    """DCP's file reader given metadata that ``read_metadata`` has already checked."""

    def __init__(self, directory: Path, metadata: Metadata) -> None:
        super().__init__(directory)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:  # type: ignore[override]  # no per-rank fallback
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def files_and_sizes(metadata: Metadata) -> dict[str, int]:
    """``{file name: bytes it must hold at least}`` of every data file the metadata names."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    return needed


def _check(metadata: Any, path: Path) -> None:
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise _refused(path, f"holds a {type(metadata).__name__}, not DCP metadata")
    for name, entry in metadata.state_dict_metadata.items():
        if not isinstance(name, str):
            raise _refused(path, f"a state name is a {type(name).__name__}")
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor(name, entry, path)
        elif not isinstance(entry, BytesStorageMetadata):
            raise _refused(path, f"{name}: a {type(entry).__name__} entry")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise _refused(path, "no storage table")
    for info in storage.values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or not DCP_FILE.fullmatch(relative):
            raise _refused(path, f"names the data file {relative!r}, not a __R_N.distcp here")
        if not all(_count(getattr(info, key, None)) for key in ("offset", "length")):
            raise _refused(path, f"{relative}: a byte range that is not two counts")


def _check_tensor(name: str, entry: TensorStorageMetadata, path: Path) -> None:
    dtype = getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise _refused(path, f"{name}: no tensor dtype")
    if not _shape(entry.size) or not isinstance(entry.chunks, list):
        raise _refused(path, f"{name}: size {entry.size!r} is not a tensor shape")
    for chunk in entry.chunks:
        if not isinstance(chunk, ChunkStorageMetadata) or not (
            _shape(chunk.offsets) and _shape(chunk.sizes)
        ):
            raise _refused(path, f"{name}: a chunk that is not a tensor shape")


def _shape(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(0 <= dim <= MAX_DIM for dim in value)


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_DIM


def _refused(path: Path, what: str) -> GoodputError:
    return GoodputError(
        path,
        f"refused as checkpoint metadata ({what})",
        "nothing in it was run; use a checkpoint written by goodput, or an older complete one",
    )
