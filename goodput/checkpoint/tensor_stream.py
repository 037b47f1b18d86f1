"""A DCP checkpoint written one whole tensor at a time by one process: how an import writes a
model larger than the memory of the machine converting it.

``dcp.save`` plans over the whole state dict, so every tensor must exist at once. The files
written here are what torch's ``FileSystemWriter`` writes for one rank instead: each tensor
``torch.save``d at an offset of a ``__0_N.distcp`` file (a new file every ``FILE_BYTES``), one
chunk per tensor, and ``.metadata``, the pickled ``Metadata`` saying where each lies, written
last. DCP's reader then loads them in any layout, as it loads a checkpoint of one rank, and
goodput's ``read_metadata`` checks them as it checks every other.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from goodput.checkpoint.checksums import ALGORITHM
from goodput.io import write_bytes
from goodput.rundir import METADATA

FILE_BYTES = 4 << 30


class TensorStream:
    """``add`` tensors one by one into ``directory`` (which must exist), then ``finish``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.tensors: dict[str, TensorStorageMetadata] = {}
        self.storage: dict[MetadataIndex, _StorageInfo] = {}
        self.file: BinaryIO | None = None
        self.hashes: dict[str, Any] = {}  # file name -> its SHA-256 so far, fed as it is written

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.tensors:
            raise ValueError(f"{name} written twice")
        tensor = tensor.detach().cpu().contiguous()
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # a view: torch.save would write its whole storage
        if self.file is None or self.file.tell() >= FILE_BYTES:
            self._next_file()
        assert self.file is not None
        file_name = Path(self.file.name).name
        offset = self.file.tell()
        torch.save(tensor, cast(BinaryIO, _Hashed(self.file, self.hashes[file_name])))
        length = self.file.tell() - offset
        origin = torch.Size([0] * tensor.dim())
        self.tensors[name] = TensorStorageMetadata(
            properties=TensorProperties.create_from_tensor(tensor),
            size=tensor.size(),
            chunks=[ChunkStorageMetadata(offsets=origin, sizes=tensor.size())],
        )
        self.storage[MetadataIndex(name, origin)] = _StorageInfo(
            relative_path=file_name, offset=offset, length=length
        )

    def finish(self) -> None:
        """Flush the data files, then write ``.metadata``: the checkpoint's last DCP file."""
        self._close_file()
        metadata = Metadata(
            state_dict_metadata=dict(self.tensors),
            storage_data=self.storage,
            storage_meta=StorageMeta(),
        )
        write_bytes(self.directory / METADATA, pickle.dumps(metadata))

    def digests(self) -> dict[str, str]:
        """``{file name: SHA-256}`` of the data files written (``checksums.json``'s entries),
        hashed from the bytes as they were written: the files are not read again."""
        return {name: digest.hexdigest() for name, digest in self.hashes.items()}

    def close(self) -> None:
        """Close an unfinished stream's file (the caller removes what it wrote)."""
        if self.file is not None:
            self.file.close()
            self.file = None

    def _next_file(self) -> None:
        self._close_file()
        name = f"__0_{len(self.hashes)}.distcp"
        self.file = open(self.directory / name, "xb")  # noqa: SIM115
        self.hashes[name] = hashlib.new(ALGORITHM)

    def _close_file(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.close()


class _Hashed:
    """A file torch.save writes through, feeding the file's hash with the same bytes."""

    def __init__(self, file: BinaryIO, digest: Any) -> None:
        self.file, self.digest = file, digest

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()
