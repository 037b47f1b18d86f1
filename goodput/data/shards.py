"""Megatron-compatible token shards: ``<prefix>.bin`` (raw tokens) + ``<prefix>.idx`` (MMIDIDX).

The ``.idx`` layout, all little-endian: magic ``MMIDIDX\\0\\0``, uint64 version (1), uint8 dtype
code, uint64 sequence count S, uint64 document-boundary count D (= documents + 1), then int32
``sequence_lengths[S]``, int64 ``sequence_pointers[S]`` (byte offsets into ``.bin``) and int64
``document_indices[D]`` (document k = sequences ``[di[k], di[k+1])``). We write one sequence per
document, with the end-of-document token inside the document and counted in its length (the bug
Megatron fixed in its issue #431 and BlendCorpus still has). The reader accepts any valid file,
including multi-sequence documents written by Megatron's ``--split-sentences``.

Writers produce ``.bin`` and ``.idx`` under temp names and rename them only when complete; the
reader validates sizes before trusting a file, so a truncated or foreign file is an error naming
it, never garbage tokens.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from pathlib import Path

import numpy as np

from goodput.errors import GoodputError, from_exception
from goodput.io import atomic_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document boundaries
DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
UINT16_MAX_VOCAB = 65536


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab ≤ 65,536, the rule datatrove and Megatron's GPT config
    use), else int32: the format has no uint32 code."""
    if vocab_size <= UINT16_MAX_VOCAB:
        return np.dtype(np.uint16)
    if vocab_size <= np.iinfo(np.int32).max:
        return np.dtype(np.int32)
    raise GoodputError(
        "tokenizer",
        f"vocab size {vocab_size:,} does not fit the largest token "
        "dtype of the .bin format (int32)",
        "use a tokenizer with a smaller vocab",
    )


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


class ShardWriter:
    """Append documents to one shard; ``finish()`` makes both files appear atomically.

    ``.bin`` is streamed to a temp file as documents arrive; lengths stay in numpy chunks (not
    Python lists, which is what makes Megatron's builder run out of memory on large merges).
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        self._bin_ctx = atomic_path(bin_path(prefix))
        self._bin_tmp = self._bin_ctx.__enter__()
        self._bin = open(self._bin_tmp, "wb", buffering=8 << 20)  # noqa: SIM115 - closed in finish
        self._length_chunks: list[np.ndarray] = []
        self._bin_digest = hashlib.sha256()  # hashed as written: no second read of the shard
        self.num_documents = 0
        self.num_tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one flat token array and their lengths (EOD included)."""
        assert tokens.dtype == self.dtype and int(lengths.sum()) == len(tokens)
        data = np.ascontiguousarray(tokens).data.cast("B")
        self._bin.write(data)
        self._bin_digest.update(data)
        self._length_chunks.append(lengths.astype(np.int32, copy=False))
        self.num_documents += len(lengths)
        self.num_tokens += len(tokens)

    def finish(self) -> str:
        """Close ``.bin``, write ``.idx``; both appear under their final names only now.

        Returns the sha256 of the ``.bin``."""
        self._bin.close()
        lengths = (
            np.concatenate(self._length_chunks) if self._length_chunks else np.zeros(0, np.int32)
        )
        self._bin_ctx.__exit__(None, None, None)
        write_index(idx_path(self.prefix), lengths, self.dtype)
        return self._bin_digest.hexdigest()

    def abort(self) -> None:
        self._bin.close()
        self._bin_ctx.__exit__(RuntimeError, RuntimeError("aborted"), None)


def write_index(path: Path, lengths: np.ndarray, dtype: np.dtype) -> None:
    """Write an MMIDIDX index for documents of one sequence each."""
    num_sequences = len(lengths)
    pointers = np.zeros(num_sequences, np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    document_indices = np.arange(num_sequences + 1, dtype=np.int64)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(
            HEADER.pack(
                MAGIC, VERSION, CODE_OF_DTYPE[np.dtype(dtype)], num_sequences, num_sequences + 1
            )
        )
        for array in (
            lengths.astype("<i4", copy=False),
            pointers.astype("<i8", copy=False),
            document_indices.astype("<i8", copy=False),
        ):
            f.write(array.data.cast("B"))


class ShardReader:
    """Memory-mapped read access to one ``.bin/.idx`` pair.

    ``len(reader)`` is the number of documents, ``reader[i]`` the i-th document's tokens (EOD
    included) as a read-only numpy view, ``reader.num_tokens`` the total. ``document_lengths`` and
    ``document_offsets`` (token offsets into ``.bin``) serve index builders without a Python loop.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = Path(prefix)
        where = idx_path(prefix)
        index = _map(where, np.dtype(np.uint8), _size(where))
        if len(index) < HEADER.size:
            raise _corrupt(
                where,
                f"{len(index)} bytes is shorter than the {HEADER.size}-byte header (truncated)",
            )
        header = HEADER.unpack_from(bytes(index[: HEADER.size]))
        magic, version, code, num_sequences, num_boundaries = header
        if magic != MAGIC:
            raise _corrupt(where, "not an MMIDIDX index (bad magic)")
        if version != VERSION:
            raise _corrupt(where, f"index version {version}; only version {VERSION} exists")
        if code not in DTYPE_CODES:
            raise _corrupt(where, f"unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if self.dtype.kind not in "iu":
            raise _corrupt(where, f"dtype code {code} ({self.dtype}) is not an integer token type")
        expected = HEADER.size + 12 * num_sequences + 8 * num_boundaries
        if len(index) < expected:
            raise _corrupt(
                where, f"{len(index)} bytes, the header promises at least {expected} (truncated)"
            )
        offset = HEADER.size
        lengths = np.frombuffer(index, "<i4", num_sequences, offset)
        pointers = np.frombuffer(index, "<i8", num_sequences, offset + 4 * num_sequences)
        boundaries = np.frombuffer(index, "<i8", num_boundaries, offset + 12 * num_sequences)
        steps = np.diff(boundaries)  # sequences per document
        if (
            num_boundaries < 1
            or boundaries[0] != 0
            or boundaries[-1] != num_sequences
            or (steps < 0).any()
        ):
            raise _corrupt(where, "document boundaries do not cover the sequences in order")
        self._check_pointers(where, lengths, pointers)
        self.num_tokens = int(lengths.sum(dtype=np.int64))
        self._tokens = self._map_tokens()
        seq_offsets = pointers // self.dtype.itemsize
        if (steps == 1).all():  # one sequence per document: the common case
            self.document_lengths = lengths
            self.document_offsets = seq_offsets
        else:
            starts = boundaries[:-1]
            self.document_offsets = seq_offsets[starts] if num_sequences else seq_offsets
            ends = np.append(seq_offsets, self.num_tokens)[boundaries[1:]]
            self.document_lengths = (ends - self.document_offsets).astype(np.int64)

    def _check_pointers(self, where: Path, lengths: np.ndarray, pointers: np.ndarray) -> None:
        if len(lengths) == 0:
            return
        expected = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=expected[1:])
        if (lengths < 0).any() or not np.array_equal(pointers, expected * self.dtype.itemsize):
            raise _corrupt(where, "sequence pointers do not match the lengths")

    def _map_tokens(self) -> np.ndarray:
        path = bin_path(self.prefix)
        size = _size(path)
        expected = self.num_tokens * self.dtype.itemsize
        if size != expected:
            raise _corrupt(
                path,
                f"{size:,} bytes, the index promises {expected:,} "
                f"({'truncated' if size < expected else 'trailing data'})",
            )
        return _map(path, self.dtype, self.num_tokens)

    def __len__(self) -> int:
        return len(self.document_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"document {i} out of range for {len(self)} documents")
        start = int(self.document_offsets[i])
        return self._tokens[start : start + int(self.document_lengths[i])]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the ``.bin``, as stored."""
        return self._tokens[start:stop]


def _size(path: Path) -> int:
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise GoodputError(
            path,
            "missing",
            "check the path prefix (without .bin/.idx) or re-run `goodput data tokenize`",
        ) from None
    except OSError as exc:
        raise from_exception(exc) from None
    if not stat.S_ISREG(status.st_mode):
        raise GoodputError(path, "is not a regular file", "pass the path prefix of a shard")
    return status.st_size


def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """The first ``count`` items of ``path``, memory-mapped read-only."""
    if count == 0:
        return np.zeros(0, dtype)
    try:
        return np.memmap(path, dtype, mode="r", shape=(count,))
    except OSError as exc:
        raise from_exception(exc) from None


def _corrupt(path: Path, what: str) -> GoodputError:
    return GoodputError(
        path,
        f"corrupt shard: {what}",
        "re-run `goodput data tokenize` into a fresh output (resume redoes it)",
    )
