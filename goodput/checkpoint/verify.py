"""Checking a checkpoint against its ``checksums.json`` before it is resumed, on every rank.

Rank 0 reads the reference digests and the file sizes and sends them to all; the ranks then
split the hashing — each file to the rank with the fewest bytes so far, largest files first —
so the check costs about (checkpoint bytes / ranks) of hashing per rank, and every rank learns
every verdict. The hashing runs in a background thread from ``start_verification`` to
``result``, so the trainer builds its model meanwhile (hashlib and file reads release the GIL).
A checkpoint saved before goodput wrote checksums cannot be verified: the verdict says so and
the caller decides. Nothing is written.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from goodput.checkpoint.checksums import first_mismatch, read_checksums
from goodput.errors import GoodputError


@dataclass(frozen=True, slots=True)
class Verdict:
    checksummed: bool  # False: the checkpoint has no checksums.json, nothing was checked
    problem: str | None  # the first file that does not match, as "NAME: why"
    num_bytes: int  # hashed, over all ranks
    hashing_s: float  # this rank's share, in the background
    waited_s: float  # what ``result`` blocked for: hashing not hidden behind other work, and peers


class PendingVerification:
    """This rank's share of the hashing, running; ``result`` is the collective end."""

    def __init__(self, directory: Path) -> None:
        """Collective over every rank: agree on the reference, start hashing this rank's share."""
        rank, world_size = dist.get_rank(), dist.get_world_size()
        reference: list[Any] = [None]
        if rank == 0:
            reference[0] = _reference(directory)
        dist.broadcast_object_list(reference, src=0)
        self._reference = reference[0]
        self._problem: str | None = None
        self._hashing_s = 0.0
        self._thread: threading.Thread | None = None
        if isinstance(self._reference, tuple):
            expected, sizes = self._reference
            share = {name: expected[name] for name in assign(sizes, world_size)[rank]}
            self._thread = threading.Thread(
                target=self._hash, args=(directory, share), name="goodput-verify", daemon=True
            )
            self._thread.start()

    def _hash(self, directory: Path, share: dict[str, str]) -> None:
        start = time.perf_counter()
        try:
            self._problem = first_mismatch(directory, share)
        except OSError as exc:  # unreadable now although it was there a moment ago
            self._problem = f"{exc.filename}: {exc.strerror}"
        self._hashing_s = time.perf_counter() - start

    def result(self) -> Verdict:
        """Collective over every rank: wait for all shares; the first problem any rank found."""
        if self._reference is None:
            return Verdict(False, None, 0, 0.0, 0.0)
        if isinstance(self._reference, str):  # checksums.json itself is broken
            return Verdict(True, self._reference, 0, 0.0, 0.0)
        assert self._thread is not None
        start = time.perf_counter()
        self._thread.join()
        problems: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, self._problem)
        found = next((p for p in problems if p is not None), None)
        num_bytes = sum(self._reference[1].values())
        return Verdict(True, found, num_bytes, self._hashing_s, time.perf_counter() - start)


def assign(sizes: dict[str, int], num_ranks: int) -> list[list[str]]:
    """The files each rank hashes: largest first, each to the least loaded rank."""
    shares: list[list[str]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        lightest = loads.index(min(loads))
        shares[lightest].append(name)
        loads[lightest] += sizes[name]
    return shares


def _reference(directory: Path) -> tuple[dict[str, str], dict[str, int]] | str | None:
    """(digests, sizes) of the checkpoint's files; None without checksums; a problem line when
    checksums.json is unreadable or names a file that is not there."""
    try:
        expected = read_checksums(directory)
    except GoodputError as exc:
        return f"{exc.where}: {exc.what}"
    if expected is None:
        return None
    sizes = {}
    for name in expected:
        path = directory / name
        if not path.is_file():
            return f"{name}: missing"
        sizes[name] = path.stat().st_size
    return expected, sizes
