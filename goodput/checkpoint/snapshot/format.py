"""The format of an in-memory checkpoint (a snapshot, for short): the tensor table of its payload,
the digests of the payload's chunks, and its manifest.

A snapshot (``[checkpoint] memory_interval_steps``) is one rank's checkpoint state in two files
of a private tmpfs folder (``files``): a payload (every tensor of ``flatten_state``, packed at
``ALIGN``-byte offsets in key order, ``tensor_table``) and a manifest (JSON, ``manifest_bytes``)
that names the run, the step, the layout, the SHA-256 of each ``chunk_bytes`` chunk of the
payload, the train state and the RNG state. The store (``store``) writes the manifest last, so a
payload without one is a half-written snapshot and is never read.

Trust: a manifest comes from an earlier process, another rank or another run, so
``parse_manifest`` is strict and bounded (``MAX_MANIFEST_BYTES``, exact keys and types, the
layout recomputed from the table, ``load.check_train_state``); anything else is a
``GoodputError`` naming where it came from. Nothing is unpickled: tensors are raw bytes of an
allow-listed dtype at offsets the reader recomputes. Pure: no threads except
``chunk_digests``'s pool, no process groups, no files.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from goodput.checkpoint.load import MAX_STEP, MAX_WORLD, brief, check_train_state
from goodput.errors import GoodputError
from goodput.io import json_text, json_type_name, sha256_json

MAGIC = "goodput-snapshot"
VERSION = 1
CHUNK_BYTES = 64 * 2**20
ALIGN = 64
MAX_MANIFEST_BYTES = 64 * 2**20
MAX_TENSORS = 1_000_000
MAX_PAYLOAD_BYTES = 2**50
MAX_NDIM = 64
MAX_KEY_CHARS = 4096
DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
}
HEX16 = re.compile(r"[0-9a-f]{16}")
HEX64 = re.compile(r"[0-9a-f]{64}")
FIX = "the snapshot is not used: the run resumes from another one or from the disk checkpoint"


# --- tensors -----------------------------------------------------------------------------------


def flatten_state(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``{"model": {fqn: t}, "optim": {fqn: {"exp_avg": t}}}`` as ``{"model/fqn": t,
    "optim/fqn/exp_avg": t}``, sorted by key; a DTensor as its local shard. The tensors are the
    live ones (no copy), so the store copies into and out of them."""
    flat: dict[str, torch.Tensor] = {}
    _flatten(state, "", flat)
    return dict(sorted(flat.items()))


def _flatten(state: Mapping[str, Any], prefix: str, flat: dict[str, torch.Tensor]) -> None:
    for name, value in state.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"state key {prefix}{name!r}: not a name without '/'")
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            _flatten(value, f"{key}/", flat)
        elif isinstance(value, DTensor):
            flat[key] = value.to_local()  # this rank's shard, sharing its memory
        elif isinstance(value, torch.Tensor):
            flat[key] = value
        else:
            raise ValueError(f"state entry {key} is {type(value).__name__}, not a tensor")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """One tensor of a payload: ``nbytes`` bytes at ``offset``, viewed as ``dtype`` ``shape``."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, the name a manifest records."""
    return str(dtype).removeprefix("torch.")


def tensor_table(flat: Mapping[str, torch.Tensor]) -> tuple[TensorEntry, ...]:
    """The payload layout of ``flat``: entries in key order, each at the next ``ALIGN``-aligned
    offset. A dtype outside ``DTYPES`` is a usage error: such a state cannot be snapshotted."""
    for key, tensor in flat.items():
        if dtype_name(tensor.dtype) not in DTYPES:
            raise GoodputError.usage(
                "[checkpoint] memory_interval_steps",
                f"state tensor {key} is {dtype_name(tensor.dtype)}, which memory snapshots do "
                f"not hold (only {', '.join(DTYPES)})",
                "set memory_interval_steps = 0",
            )
    return _packed([(key, dtype_name(t.dtype), tuple(t.shape)) for key, t in sorted(flat.items())])


def _packed(specs: Sequence[tuple[str, str, tuple[int, ...]]]) -> tuple[TensorEntry, ...]:
    # The one packing rule: the writer's table and the reader's recomputation come from here.
    entries = []
    offset = 0
    for key, dtype, shape in specs:
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        entries.append(TensorEntry(key=key, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes))
        offset = _aligned(offset + nbytes)
    return tuple(entries)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def payload_size(table: Sequence[TensorEntry]) -> int:
    """Bytes of the payload file holding ``table``: its last tensor's end, ``ALIGN``-rounded."""
    return _aligned(table[-1].offset + table[-1].nbytes) if table else 0


def layout_digest(table: Sequence[TensorEntry]) -> str:
    """SHA-256 (hex) over the keys, dtypes and shapes: equal for two states that fit one
    payload (offsets follow from them)."""
    return sha256_json([[entry.key, entry.dtype, list(entry.shape)] for entry in table])


def tensor_view(payload: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """``entry``'s tensor inside ``payload`` (a flat uint8 tensor, e.g. a mapped slot file),
    sharing its memory."""
    raw = payload[entry.offset : entry.offset + entry.nbytes]
    return raw.view(DTYPES[entry.dtype]).view(entry.shape)


# --- chunks ------------------------------------------------------------------------------------


def chunk_count(payload_bytes: int, chunk_bytes: int) -> int:
    return -(-payload_bytes // chunk_bytes)


def chunk_bounds(payload_bytes: int, chunk_bytes: int, index: int) -> tuple[int, int]:
    """``(start, end)`` of chunk ``index`` of a payload."""
    start = index * chunk_bytes
    return start, min(start + chunk_bytes, payload_bytes)


def chunk_digests(
    payload: memoryview, chunk_bytes: int = CHUNK_BYTES, workers: int = 1
) -> list[str]:
    """SHA-256 (hex) of each ``chunk_bytes`` chunk of ``payload``, in order; ``workers`` > 1
    hashes chunks in a thread pool (hashlib releases the GIL on large buffers)."""
    data = payload.cast("B")
    bounds = [
        chunk_bounds(len(data), chunk_bytes, i) for i in range(chunk_count(len(data), chunk_bytes))
    ]

    def digest(span: tuple[int, int]) -> str:
        return hashlib.sha256(data[span[0] : span[1]]).hexdigest()

    if workers <= 1 or len(bounds) <= 1:
        return [digest(span) for span in bounds]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="goodput-digest") as pool:
        return list(pool.map(digest, bounds))


def first_bad_chunk(payload: memoryview, manifest: Manifest, workers: int = 1) -> int | None:
    """The index of the first chunk of ``payload`` whose SHA-256 differs from the manifest's
    (or a payload of another size: chunk 0); None when every chunk matches."""
    if len(payload.cast("B")) != manifest.payload_bytes:
        return 0
    digests = chunk_digests(payload, manifest.chunk_bytes, workers)
    pairs = enumerate(zip(digests, manifest.chunks, strict=True))
    return next((index for index, (a, b) in pairs if a != b), None)


# --- manifest ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """What a snapshot holds and how to check it (see the module docstring).

    ``train_state`` is what a checkpoint's ``train_state.json`` holds (``{"step": step,
    **contents.train_state(), "world_size": ..., "optimizer_param_groups": ...}``, its step the
    manifest's); ``rng`` is ``state.rng_state`` of the owning rank; ``hosts_shape`` is
    ``hosts_shape(hosts)``; ``chunks`` the ``chunk_digests`` of the payload.
    """

    run_id: str
    run_key: str
    step: int
    rank: int
    world_size: int
    hosts_shape: tuple[int, int]
    config_digest: str
    layout: str
    payload_bytes: int
    chunk_bytes: int
    chunks: tuple[str, ...]
    tensors: tuple[TensorEntry, ...]
    train_state: dict[str, Any]
    rng: dict[str, Any]


_KEYS = {
    "magic",
    "version",
    "run_id",
    "run_key",
    "step",
    "rank",
    "world_size",
    "hosts_shape",
    "config_digest",
    "layout",
    "payload_bytes",
    "chunk_bytes",
    "chunks",
    "tensors",
    "train_state",
    "rng",
}


def manifest_bytes(manifest: Manifest) -> bytes:
    """The manifest as canonical JSON (sorted keys, one line), tensors as ``[key, dtype, shape,
    offset, nbytes]``; a non-finite number in the train state is a ``GoodputError``."""
    value = {
        "magic": MAGIC,
        "version": VERSION,
        "run_id": manifest.run_id,
        "run_key": manifest.run_key,
        "step": manifest.step,
        "rank": manifest.rank,
        "world_size": manifest.world_size,
        "hosts_shape": list(manifest.hosts_shape),
        "config_digest": manifest.config_digest,
        "layout": manifest.layout,
        "payload_bytes": manifest.payload_bytes,
        "chunk_bytes": manifest.chunk_bytes,
        "chunks": list(manifest.chunks),
        "tensors": [[e.key, e.dtype, list(e.shape), e.offset, e.nbytes] for e in manifest.tensors],
        "train_state": manifest.train_state,
        "rng": manifest.rng,
    }
    return json_text(value, where="memory snapshot manifest", sort_keys=True).encode()


def parse_manifest(data: bytes, where: str) -> Manifest:
    """The manifest ``data`` holds (read from ``where``: a file or a partner rank), strictly
    checked; anything else is a ``GoodputError`` naming ``where``."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise _bad(where, f"is larger than {MAX_MANIFEST_BYTES:,} bytes")
    raw = _json_object(data, where)
    if set(raw) != _KEYS:
        missing, extra = sorted(_KEYS - set(raw)), sorted(set(raw) - _KEYS)
        raise _bad(where, f"has keys missing {missing} or unknown {extra}")
    if raw["magic"] != MAGIC or type(raw["version"]) is not int or raw["version"] != VERSION:
        raise _bad(where, f"is not a {MAGIC} manifest of version {VERSION}")
    step = _count(raw, "step", where, MAX_STEP)
    world_size = _count(raw, "world_size", where, MAX_WORLD, low=1)
    rank = _count(raw, "rank", where, world_size - 1)
    payload_bytes = _count(raw, "payload_bytes", where, MAX_PAYLOAD_BYTES)
    chunk_bytes = _count(raw, "chunk_bytes", where, MAX_PAYLOAD_BYTES, low=1)
    tensors = _tensors(raw["tensors"], where)
    if payload_bytes != payload_size(tensors):
        raise _bad(
            where, f"payload_bytes {payload_bytes} is not its tensors' {payload_size(tensors)}"
        )
    chunks = _digests(raw["chunks"], where)
    if len(chunks) != chunk_count(payload_bytes, chunk_bytes):
        raise _bad(
            where,
            f"has {len(chunks)} chunk digests for {payload_bytes} bytes in chunks of {chunk_bytes}",
        )
    layout = _hex(raw, "layout", HEX64, where)
    if layout != layout_digest(tensors):
        raise _bad(where, "layout is not the digest of its tensor table")
    try:
        train_state = check_train_state(raw["train_state"], Path(where))
    except GoodputError as error:  # the checkpoint reader's wording, this reader's fix
        raise _bad(where, f"train_state: {error.what}") from None
    if train_state.get("model_only") is True or train_state["step"] != step:
        raise _bad(where, f"train_state is not the full state of step {step}")
    if not isinstance(raw["rng"], dict):
        raise _bad(where, "rng is not a JSON object")
    return Manifest(
        run_id=_hex(raw, "run_id", HEX16, where),
        run_key=_hex(raw, "run_key", HEX16, where),
        step=step,
        rank=rank,
        world_size=world_size,
        hosts_shape=_hosts_shape(raw["hosts_shape"], world_size, where),
        config_digest=_hex(raw, "config_digest", HEX64, where),
        layout=layout,
        payload_bytes=payload_bytes,
        chunk_bytes=chunk_bytes,
        chunks=chunks,
        tensors=tensors,
        train_state=train_state,
        rng=raw["rng"],
    )


def _json_object(data: bytes, where: str) -> dict[str, Any]:
    try:
        raw = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as exc:
        raise _bad(where, f"is not UTF-8 (byte {exc.start})") from None
    except (ValueError, RecursionError):  # not JSON, NaN/Infinity, a 5000-digit int, nesting
        raise _bad(where, "is not valid JSON") from None
    if not isinstance(raw, dict):
        raise _bad(where, f"is {json_type_name(raw)}, not a JSON object")
    return raw


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _count(raw: dict[str, Any], key: str, where: str, high: int, *, low: int = 0) -> int:
    value = raw[key]
    if type(value) is not int or not low <= value <= high:
        raise _bad(where, f"{key} is {brief(value)}, not a whole number in {low}..{high}")
    return value


def _hex(raw: dict[str, Any], key: str, pattern: re.Pattern[str], where: str) -> str:
    value = raw[key]
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise _bad(where, f"{key} is {brief(value)}, not lowercase hex")
    return value


def _digests(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, str) and HEX64.fullmatch(d) for d in value
    ):
        raise _bad(where, "chunks is not a list of SHA-256 digests")
    return tuple(value)


def _hosts_shape(value: Any, world_size: int, where: str) -> tuple[int, int]:
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(type(n) is int for n in value)
        and 1 <= value[0] <= world_size
        and (value[1] == 0 or value[0] * value[1] == world_size)
    ):
        raise _bad(where, f"hosts_shape is {brief(value)}, not [hosts, ranks per host or 0]")
    return value[0], value[1]


def _tensors(value: Any, where: str) -> tuple[TensorEntry, ...]:
    if not isinstance(value, list) or len(value) > MAX_TENSORS:
        raise _bad(where, f"tensors is not a list of at most {MAX_TENSORS:,} entries")
    specs = [_tensor_spec(item, where) for item in value]
    keys = [key for key, _, _ in specs]
    if any(a >= b for a, b in itertools.pairwise(keys)):
        raise _bad(where, "tensors are not in strictly increasing key order")
    table = _packed(specs)
    for item, entry in zip(value, table, strict=True):
        if item[3:] != [entry.offset, entry.nbytes]:
            raise _bad(
                where,
                f"tensor {brief(entry.key)} is at {brief(item[3])} with {brief(item[4])} "
                f"bytes, not at {entry.offset} with {entry.nbytes}",
            )
    return table


def _tensor_spec(item: Any, where: str) -> tuple[str, str, tuple[int, ...]]:
    if not (
        isinstance(item, list)
        and len(item) == 5
        and isinstance(item[0], str)
        and 0 < len(item[0]) <= MAX_KEY_CHARS
        and isinstance(item[1], str)
        and item[1] in DTYPES
        and isinstance(item[2], list)
        and len(item[2]) <= MAX_NDIM
        and all(type(n) is int and 0 <= n <= MAX_PAYLOAD_BYTES for n in item[2])
        and type(item[3]) is int
        and type(item[4]) is int
        and math.prod(item[2]) <= MAX_PAYLOAD_BYTES
    ):
        raise _bad(where, f"tensor entry {brief(item)} is not [key, dtype, shape, offset, nbytes]")
    return item[0], item[1], tuple(item[2])


def _bad(where: str, what: str) -> GoodputError:
    return GoodputError(where, f"memory snapshot manifest {what}", FIX)
