"""The ``.npy`` index arrays a blend reads: where they live, how they are saved, read and checked.

A blend reads, besides its shards, in its own folder ``corpus_index.npy`` (int16: the corpus of
every sample), ``sample_index.npy`` (int64: its running number in that corpus), one
``corpus_NNNN.npy`` per corpus (uint32 or int64: the corpus's sample order) and, when it holds
samples out for evaluation, one ``heldout_NNNN.npy`` per corpus (int64: the held-out sample
numbers); and for each shard that is not packed, in the cache's ``files/<sha256>-seed<S>/``,
``document_order.npy`` and ``document_starts.npy`` (int64), with their checksums in
``sha256.json`` beside them (they are shared by every blend of the shard, and a later blend must
not pin a damaged one). ``index_files`` lists them all with the dtype and length the run
manifest implies, keyed as ``blend.json``'s ``index_sha256`` records their checksums.

Invariants: saving is atomic. Loading never unpickles (``allow_pickle=False``): the ``.npy``
header is parsed first, and anything but a 1-D array of an expected dtype and length, with the
file size that implies — an object array included — is one line naming the file before numpy
maps it read-only. ``open_index`` refuses any array whose sha256 differs from the one recorded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from tokenize import TokenError
from typing import Any

import numpy as np

from goodput.data import schema
from goodput.errors import GoodputError, from_exception
from goodput.io import atomic_path, is_complete, open_regular, read_json, sha256_file

INT16, INT64, UINT32 = np.dtype("<i2"), np.dtype("<i8"), np.dtype("<u4")
SHARD_INDEX_SHA256 = "sha256.json"


@dataclass(frozen=True, slots=True)
class IndexFile:
    """One index array: where it is, the dtypes it may have and its length."""

    path: Path
    dtypes: tuple[np.dtype, ...]
    length: int


def cache_of(blend_dir: Path) -> Path:
    """The cache folder a blend directory ``CACHE/blends/<fingerprint>`` belongs to."""
    absolute = Path(blend_dir).absolute()
    if absolute.parent.name != "blends":
        raise GoodputError(
            blend_dir,
            "is not inside a cache's blends/ folder, so its per-shard indices cannot be found",
            "pass the directory `goodput data blend` printed, where it was built",
        )
    return absolute.parent.parent


def file_index_dir(cache: Path, sha256_bin: str, seed: int) -> Path:
    return cache / "files" / f"{sha256_bin[:32]}-seed{seed}"


def file_index_key(sha256_bin: str, seed: int, name: str) -> str:
    """How ``index_files`` keys the per-shard array ``name``: its path relative to the cache."""
    return file_index_dir(Path(), sha256_bin, seed).joinpath(name).as_posix()


def corpus_order_name(corpus: int) -> str:
    return f"corpus_{corpus:04d}.npy"


def heldout_name(corpus: int) -> str:
    return f"heldout_{corpus:04d}.npy"


def index_files(blend_dir: Path, manifest: dict[str, Any]) -> dict[str, IndexFile]:
    """Every index array the blend of ``manifest`` reads; keys are file names in the blend
    directory, and ``files/<folder>/<name>`` for per-shard arrays in the cache."""
    num_samples = manifest["num_samples"]
    files = {
        "corpus_index.npy": IndexFile(blend_dir / "corpus_index.npy", (INT16,), num_samples),
        "sample_index.npy": IndexFile(blend_dir / "sample_index.npy", (INT64,), num_samples),
    }
    for c, row in enumerate(manifest["report"]["corpora"]):
        name = corpus_order_name(c)
        files[name] = IndexFile(blend_dir / name, (UINT32, INT64), row["samples"])
        if manifest.get("holdout_samples"):
            held = heldout_name(c)
            files[held] = IndexFile(blend_dir / held, (INT64,), manifest["holdout_samples"])
    cache = cache_of(blend_dir)
    for shard in manifest["shards"]:
        if shard["packed"]:
            continue  # row s of a packed shard is sample s: no index
        sha256_bin, seed = shard["sha256_bin"], manifest["seed"]
        for name, file in shard_index_files(cache, sha256_bin, seed, shard["num_documents"]):
            files[file_index_key(sha256_bin, seed, name)] = file
    return files


def shard_index_files(
    cache: Path, sha256_bin: str, seed: int, num_documents: int
) -> list[tuple[str, IndexFile]]:
    """The seeded document order of a shard and each document's start in that order."""
    directory = file_index_dir(cache, sha256_bin, seed)
    return [
        (name, IndexFile(directory / name, (INT64,), length))
        for name, length in (
            ("document_order.npy", num_documents),
            ("document_starts.npy", num_documents + 1),
        )
    ]


def reuse_shard_index(files: list[tuple[str, IndexFile]]) -> bool:
    """Whether the per-shard index of ``shard_index_files`` is complete and intact. One without
    its ``sha256.json`` (written by an older goodput) is not: the caller rebuilds it in place."""
    directory = files[0][1].path.parent
    record = directory / SHARD_INDEX_SHA256
    if not (is_complete(directory) and record.is_file()):
        return False
    recorded = read_json(record)
    schema.check(record, recorded, {name: schema.SHA256 for name, _ in files})
    for name, file in files:
        _checked(name, file, recorded)
    return True


def save_array(path: Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)


def load_array(file: IndexFile) -> np.ndarray:
    """The array of ``file``, memory-mapped read-only, after its header and size checked out."""
    if not os.path.lexists(file.path):
        raise _bad_array(file.path, "missing")
    try:
        with open_regular(file.path) as f:  # a FIFO is refused, not waited on
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise _bad_array(file.path, f"unsupported .npy format version {version}")
            offset = f.tell()
            size = os.fstat(f.fileno()).st_size
    except GoodputError:
        raise
    except OSError as exc:
        raise from_exception(exc) from None
    except (ValueError, TypeError, EOFError, SyntaxError, TokenError) as exc:
        # What numpy's header parser (and the ast/tokenize modules under it) raise on bad bytes.
        raise _bad_array(file.path, f"not a valid .npy file ({exc})") from None
    if dtype not in file.dtypes:
        raise _bad_array(
            file.path, f"dtype {dtype}, expected {' or '.join(str(d) for d in file.dtypes)}"
        )
    if shape != (file.length,):
        raise _bad_array(file.path, f"shape {shape}, blend.json implies ({file.length},)")
    expected_size = offset + file.length * dtype.itemsize
    if size != expected_size:
        raise _bad_array(file.path, f"{size:,} bytes, its header implies {expected_size:,}")
    try:
        return np.load(file.path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise _bad_array(file.path, f"cannot be mapped ({exc})") from None


def open_index(
    blend_json: Path, manifest: dict[str, Any], *, hashed: bool = True
) -> dict[str, np.ndarray]:
    """Every index array of a blend, keyed as ``index_files`` keys them, checked against
    ``manifest`` (dtype, length) and, when ``hashed``, against its recorded checksum.

    Hashing costs about a tenth of building the index (1.7 GB, a blend of 10^8 samples over
    2·10^7 documents: 1.7 s to hash, 17 s to build) and reads every page, where a rank reads
    only its own slices: the trainer hashes once, on rank 0 (``build_blend``'s cache check),
    and its ranks' loaders check headers and sizes only."""
    recorded = manifest["index_sha256"]
    files = index_files(blend_json.parent, manifest)
    _check_listed(blend_json, recorded, files)
    if not hashed:
        return {key: load_array(file) for key, file in files.items()}
    return {key: _checked(key, file, recorded) for key, file in files.items()}


def index_problems(blend_json: Path, manifest: dict[str, Any]) -> list[str]:
    """One line per problem with a blend's index arrays: unlisted, missing, malformed, changed."""
    recorded = manifest["index_sha256"]
    files = index_files(blend_json.parent, manifest)
    problems = _problems(_check_listed, blend_json, recorded, files)
    for key, file in files.items():
        problems += _problems(_checked, key, file, recorded)
    return problems


def _problems(check: Callable[..., object], *args: Any) -> list[str]:
    try:
        check(*args)
    except GoodputError as exc:
        return [exc.render()]
    return []


def _check_listed(blend_json: Path, recorded: dict[str, Any], files: dict[str, IndexFile]) -> None:
    if set(recorded) != set(files):
        raise GoodputError(
            blend_json,
            "index_sha256 does not list exactly the index arrays the blend reads",
            rebuild_fix(blend_json.parent),
        )


def _checked(key: str, file: IndexFile, recorded: dict[str, Any]) -> np.ndarray:
    array = load_array(file)
    if sha256_file(file.path) != recorded.get(key):
        raise _bad_array(file.path, "checksum mismatch (it changed since the blend was built)")
    return array


def _bad_array(path: Path, what: str) -> GoodputError:
    return GoodputError(path, f"corrupt blend index: {what}", rebuild_fix(path.parent))


def rebuild_fix(directory: Path) -> str:
    return f"delete {directory} and rerun `goodput data blend` (the rebuild is identical)"
