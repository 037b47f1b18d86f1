"""The on-memory format of a memory snapshot: tensor table, manifest, names, folders, pairing.

A memory snapshot (``[checkpoint] memory_interval_steps``) is one rank's checkpoint state in two
files of a private tmpfs folder: a payload (every tensor of ``flatten_state``, packed at
``ALIGN``-byte offsets in key order, ``tensor_table``) and a manifest (JSON, ``manifest_bytes``)
that names the run, the step, the layout, the SHA-256 of each ``chunk_bytes`` chunk of the
payload, the train state and the RNG state. The store (``checkpoint.memory``) writes the
manifest last, so a payload without one is a half-written snapshot and is never read.

Folders: ``{memory_dir}/goodput-{uid}/{run_key}/{host}/``, every level a real folder of this
user, mode 0700 (``ensure_private_dir``): inside, only this user can create or swap files, so a
file checked with ``lstat`` stays what was checked. Files: ``rank-00003.slot-0.bin|json`` (this
rank's own), ``held-00001.slot-1.bin|json`` (the copy held for rank 1, byte-identical to its
owner's); ``SNAPSHOT_FILE`` matches every name goodput writes here and nothing else.

Trust: a manifest comes from an earlier process, another rank or another run, so
``read_manifest``/``parse_manifest`` are strict and bounded (``MAX_MANIFEST_BYTES``, exact keys
and types, the layout recomputed from the table, ``load.check_train_state``); anything else is a
``GoodputError`` naming the file. Nothing is unpickled: tensors are raw bytes of an allow-listed
dtype at offsets the reader recomputes.

Pairing: a rank's partner copy lives on the next host (cyclic), at the same local index;
``newest_complete`` is the restart vote over what every rank holds. Pure: no threads except
``chunk_digests``'s pool, no process groups, no files but those named.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import stat
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from goodput.checkpoint.load import check_train_state
from goodput.errors import GoodputError
from goodput.io import (
    NotOwnFile,
    json_text,
    json_type_name,
    open_own_file,
    sha256_json,
    write_bytes,
)
from goodput.ranks import HOSTNAME

MAGIC = "goodput-snapshot"
VERSION = 1
CHUNK_BYTES = 64 * 2**20
ALIGN = 64
MAX_MANIFEST_BYTES = 64 * 2**20
MAX_TENSORS = 1_000_000
SLOTS = 2  # per kind: the newest committed snapshot and the one being written
MAX_STEP = 2**40
MAX_WORLD = 1 << 24
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
SNAPSHOT_FILE = re.compile(r"(?:rank|held)-[0-9]{5,8}\.slot-[0-9]\.(?:bin|json)")
HEX16 = re.compile(r"[0-9a-f]{16}")
HEX64 = re.compile(r"[0-9a-f]{64}")
FIX = "the snapshot is not used: the run resumes from another one or from the disk checkpoint"
Kind = Literal["own", "held"]
_PREFIX: dict[str, str] = {"own": "rank", "held": "held"}


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


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Write ``manifest`` to ``path`` atomically (temp name, fsync, rename): call it last."""
    write_bytes(path, manifest_bytes(manifest))


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
        raise _bad(where, f"{key} is {_short(value)}, not a whole number in {low}..{high}")
    return value


def _hex(raw: dict[str, Any], key: str, pattern: re.Pattern[str], where: str) -> str:
    value = raw[key]
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise _bad(where, f"{key} is {_short(value)}, not lowercase hex")
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
        raise _bad(where, f"hosts_shape is {_short(value)}, not [hosts, ranks per host or 0]")
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
                f"tensor {_short(entry.key)} is at {_short(item[3])} with {_short(item[4])} "
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
        raise _bad(where, f"tensor entry {_short(item)} is not [key, dtype, shape, offset, nbytes]")
    return item[0], item[1], tuple(item[2])


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...{text[-12:]}"


def _bad(where: str, what: str) -> GoodputError:
    return GoodputError(where, f"memory snapshot manifest {what}", FIX)


def own_file(path: Path) -> os.stat_result:
    """The ``fstat`` of ``path`` if it is a regular file (not a link) of this user; a
    ``GoodputError`` otherwise, a missing file too. Inside a ``ensure_private_dir`` folder
    nobody else can swap the file after this check."""
    try:
        fd, info = open_own_file(path)
    except NotOwnFile as refused:
        raise _bad_file(path, refused.reason) from None
    os.close(fd)
    return info


def _os_error(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "is missing"
    return f"cannot be read ({exc.strerror or exc})"


def _bad_file(path: Path, what: str) -> GoodputError:
    return GoodputError(path, f"memory snapshot file {what}", FIX)


def read_manifest(path: Path) -> Manifest:
    """The manifest in ``path``: a regular file of this user, not a link, at most
    ``MAX_MANIFEST_BYTES``, read without following links or blocking, then ``parse_manifest``."""
    try:
        fd, info = open_own_file(path)
    except NotOwnFile as refused:
        raise _bad_file(path, refused.reason) from None
    try:
        if info.st_size > MAX_MANIFEST_BYTES:
            raise _bad_file(path, f"is larger than {MAX_MANIFEST_BYTES:,} bytes")
        data = _read_at_most(fd, MAX_MANIFEST_BYTES + 1, path)
    finally:
        os.close(fd)
    return parse_manifest(data, str(path))


def _read_at_most(fd: int, limit: int, path: Path) -> bytes:
    parts = []
    size = 0
    while size < limit:
        try:
            part = os.read(fd, min(limit - size, 1 << 20))
        except OSError as exc:
            raise _bad_file(path, _os_error(exc)) from None
        if not part:
            break
        parts.append(part)
        size += len(part)
    return b"".join(parts)


# --- names and folders -------------------------------------------------------------------------


def run_key(checkpoint_root: Path) -> str:
    """16 hex of the SHA-256 of the checkpoint root's resolved absolute path: one run's
    snapshots, whatever the relative spelling of its root."""
    return hashlib.sha256(str(Path(checkpoint_root).resolve()).encode()).hexdigest()[:16]


def memory_root(memory_dir: str | None) -> Path:
    """``memory_dir`` when set; else ``/dev/shm`` when it is a writable folder (tmpfs: pages
    outlive the process, not the host), else the temp folder."""
    if memory_dir is not None:
        return Path(memory_dir)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def user_folder(memory_dir: Path) -> Path:
    """``memory_dir/goodput-{uid}``: the top of this user's private snapshot folders."""
    return Path(memory_dir) / f"goodput-{os.getuid()}"


def host_folder(memory_dir: Path, run_key: str, host: str) -> Path:
    """``memory_dir/goodput-{uid}/{run_key}/{host}``: one host's snapshots of one run."""
    if not HEX16.fullmatch(run_key):
        raise ValueError(f"run key {run_key!r} is not 16 hex digits")
    if not HOSTNAME.fullmatch(host):
        raise GoodputError(
            "memory snapshots",
            f"host name {_short(host)} is not a host name",
            "check GOODPUT_LAUNCH_HOSTS or the launcher's host list",
        )
    return user_folder(memory_dir) / run_key / host


def payload_name(kind: Kind, rank: int, slot: int) -> str:
    """``rank-00003.slot-0.bin`` (own) or ``held-00003.slot-0.bin`` (held for rank 3)."""
    return f"{_stem(kind, rank, slot)}.bin"


def manifest_name(kind: Kind, rank: int, slot: int) -> str:
    """``rank-00003.slot-0.json`` (own) or ``held-00003.slot-0.json`` (held for rank 3)."""
    return f"{_stem(kind, rank, slot)}.json"


def _stem(kind: Kind, rank: int, slot: int) -> str:
    if kind not in _PREFIX or not 0 <= rank < MAX_WORLD or not 0 <= slot < SLOTS:
        raise ValueError(f"no snapshot file for {kind!r} rank {rank} slot {slot}")
    return f"{_PREFIX[kind]}-{rank:05d}.slot-{slot}"


def ensure_private_dir(path: Path) -> Path:
    """``path`` (below a ``goodput-{uid}`` folder), created 0700 with its parents from that
    folder down; each level must be a real folder (not a link) of this user, else a
    ``GoodputError`` naming it. A level of ours open to others is closed (chmod 0700)."""
    path = Path(path)
    top = f"goodput-{os.getuid()}"
    if top not in path.parts:
        raise ValueError(f"{path} is not below a {top} folder")
    start = len(path.parts) - path.parts[::-1].index(top)
    for depth in range(start, len(path.parts) + 1):
        _private_level(Path(*path.parts[:depth]))
    return path


def _private_level(level: Path) -> None:
    fix = "remove it, or set [checkpoint] memory_dir to a folder of yours"
    try:
        os.mkdir(level, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise GoodputError(
            level.parent,
            "does not exist",
            "create it, or set [checkpoint] memory_dir to an existing folder (default /dev/shm)",
        ) from None
    except OSError as exc:
        raise GoodputError(level, f"cannot be created ({exc.strerror or exc})", fix) from None
    info = os.lstat(level)
    if stat.S_ISLNK(info.st_mode):
        raise GoodputError(level, "is a symbolic link, not a snapshot folder", fix)
    if not stat.S_ISDIR(info.st_mode):
        raise GoodputError(level, "is not a folder", fix)
    if info.st_uid != os.getuid():
        raise GoodputError(level, f"is owned by uid {info.st_uid}, not this user", fix)
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(level, 0o700)


# --- pairing and the restart vote --------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Pairing:
    """Where a rank's partner copy goes (``holder``) and whose copy it holds (``source``):
    the same local index on the next and previous host. None, None on one host or when hosts
    hold unequal numbers of ranks (no partner copy)."""

    holder: int | None
    source: int | None
    num_hosts: int

    @classmethod
    def from_hosts(cls, hosts: Sequence[str], rank: int) -> Pairing:
        """``hosts``: every rank's host, by rank."""
        if not 0 <= rank < len(hosts):
            raise ValueError(f"rank {rank} is not one of {len(hosts)} ranks")
        groups = _ranks_by_host(hosts)
        order = list(groups)
        if len(order) == 1 or hosts_shape(hosts)[1] == 0:
            return cls(holder=None, source=None, num_hosts=len(order))
        here = order.index(hosts[rank])
        index = groups[hosts[rank]].index(rank)
        after, before = order[(here + 1) % len(order)], order[here - 1]
        return cls(holder=groups[after][index], source=groups[before][index], num_hosts=len(order))


def _ranks_by_host(hosts: Sequence[str]) -> dict[str, list[int]]:
    """``{host: its ranks}``, hosts in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return groups


def hosts_shape(hosts: Sequence[str]) -> tuple[int, int]:
    """(number of hosts, ranks per host), ranks per host 0 when hosts hold unequal counts."""
    groups = _ranks_by_host(hosts)
    counts = {len(ranks) for ranks in groups.values()}
    return len(groups), counts.pop() if len(counts) == 1 else 0


def newest_complete(
    own: Sequence[Sequence[int]],
    held: Sequence[Sequence[int]],
    holders: Sequence[int | None],
    *,
    at_least: int,
) -> int | None:
    """The newest step ``s >= at_least`` that every rank ``r`` can load: ``s`` in ``own[r]``
    (its own copies) or in ``held[holders[r]]`` (the copies its holder keeps of it). Steps
    below 0 mean none. None when no step qualifies."""
    if not len(own) == len(held) == len(holders):
        raise ValueError("own, held and holders must have one entry per rank")
    low = max(at_least, 0)
    candidates = {s for steps in (*own, *held) for s in steps if s >= low}
    for step in sorted(candidates, reverse=True):
        if all(
            step in own[r] or (holder is not None and step in held[holder])
            for r, holder in enumerate(holders)
        ):
            return step
    return None
