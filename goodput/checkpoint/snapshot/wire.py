"""What the ranks of an in-memory checkpoint store send each other, on the store's own gloo group.

A snapshot travels as one message of several pieces, all with one tag (``TAG_SNAPSHOT`` to its
holder after each snapshot; ``TAG_FETCH``, ``TAG_REPLICATE``: a restart's copy sent back, or
re-sent to a holder): a header (int64 ``[ok, payload bytes, manifest bytes, chunk bytes]``;
``ok`` 0 and nothing after it when the sender has no snapshot to send, so its peer is never
left waiting for bytes that will not come), the manifest's bytes, then the payload in chunks.
The sender posts every piece at once (``isend``): two ranks sending each other a message on a
ring never wait on each other's receive. The receiver checks the header's bounds, hands the
manifest to ``accept`` (which parses it, checks it and picks the memory for the payload, or
refuses) and receives every announced chunk whatever ``accept`` said — into a scratch chunk
when refused — so the next message on the pair still lines up. Nothing is unpickled: bytes go
into uint8 tensors.

The store's collectives (``all_gather_ints``, ``all_gather_objects``, ``raise_anywhere``) are
here too: every rank reaches each of them, so a failure on one rank is raised on all alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from goodput.checkpoint.snapshot.format import (
    CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_PAYLOAD_BYTES,
    chunk_bounds,
    chunk_count,
)
from goodput.errors import GoodputError

HEADER_LENGTH = 4
TAG_SNAPSHOT, TAG_FETCH, TAG_REPLICATE = 1, 2, 3  # p2p tags: snapshot, copy back, re-replicate


def post(
    group: dist.ProcessGroup,
    dst: int,
    tag: int,
    snapshot: tuple[torch.Tensor, bytes] | None,
    chunk_bytes: int,
) -> list[dist.Work]:
    """Start sending ``snapshot`` (payload, manifest bytes) to ``dst``; None: a failure header.
    Wait for every returned work before the payload changes."""
    header = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
    pieces = [header]
    if snapshot is not None:
        payload, data = snapshot
        num = payload.numel()
        header.copy_(torch.tensor([1, num, len(data), chunk_bytes]))
        pieces.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        bounds = [chunk_bounds(num, chunk_bytes, i) for i in range(chunk_count(num, chunk_bytes))]
        pieces += [payload[start:end] for start, end in bounds]
    works = []
    for piece in pieces:
        work = dist.isend(piece, dst, group=group, tag=tag)
        assert work is not None
        works.append(work)
    return works


def receive(
    group: dist.ProcessGroup,
    src: int,
    tag: int,
    accept: Callable[[bytes, int], torch.Tensor],
) -> tuple[bytes, torch.Tensor] | str:
    """Receive one message from ``src``: (manifest bytes, the payload received into what
    ``accept(manifest bytes, payload bytes)`` returned), or why it was not kept (``accept``
    raised a ``GoodputError`` or ``OSError``, or the sender had nothing). The payload is not
    verified here: the caller checks it against the manifest."""
    header = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
    dist.recv(header, src, group=group, tag=tag)
    ok, num_bytes, num_manifest, chunk = header.tolist()
    if ok != 1:
        return f"rank {src} sent no snapshot (its own failed)"
    if not (
        0 < num_manifest <= MAX_MANIFEST_BYTES
        and 0 < num_bytes <= MAX_PAYLOAD_BYTES
        and 0 < chunk <= CHUNK_BYTES
    ):
        # Not this program's header: nothing more is read (the sender's wait times out).
        return f"rank {src} sent a header {header.tolist()} goodput does not send"
    raw = torch.empty(num_manifest, dtype=torch.uint8)
    dist.recv(raw, src, group=group, tag=tag)
    data = raw.numpy().tobytes()
    failure: str | None = None
    target: torch.Tensor | None = None
    try:
        target = accept(data, num_bytes)
    except (GoodputError, OSError) as exc:
        failure = reason(exc)
    into = target if target is not None else torch.empty(chunk, dtype=torch.uint8)
    for index in range(chunk_count(num_bytes, chunk)):
        start, end = chunk_bounds(num_bytes, chunk, index)
        piece = into[start:end] if target is not None else into[: end - start]
        dist.recv(piece, src, group=group, tag=tag)
    if target is None:
        assert failure is not None
        return failure
    return data, target


def reason(error: BaseException) -> str:
    """``error`` as the reason of a failed snapshot, one line."""
    if isinstance(error, GoodputError):
        return f"{error.where}: {error.what}"
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror} ({error.filename})" if error.filename else error.strerror
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def all_gather_ints(row: list[int], group: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's ``row`` of ints (the same length on every rank), by rank."""
    world_size = dist.get_world_size(group)
    mine = torch.tensor(row, dtype=torch.int64)
    every = torch.empty(world_size * len(row), dtype=torch.int64)
    dist.all_gather_single(every, mine, group=group)
    return every.view(world_size, len(row)).tolist()


def all_gather_objects(value: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``value`` (None or strings: a failure's reason), by rank. Pickled between
    this job's own ranks, as the checkpoint's outcomes are (save.py); nothing read from disk."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, value, group=group)
    return every


def raise_anywhere(error: GoodputError | None, group: dist.ProcessGroup) -> None:
    """Raise on every rank when ``error`` happened on any (this rank's own, else the first
    failing rank's, named), so no rank goes on into a collective its peers never join."""
    mine = None if error is None else (error.where, error.what, error.fix)
    for rank, theirs in enumerate(all_gather_objects(mine, group)):
        if error is not None:
            raise error
        if theirs is not None:
            where, what, fix = theirs
            raise GoodputError(where, f"on rank {rank}: {what}", fix)
