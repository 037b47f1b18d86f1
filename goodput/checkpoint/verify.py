"""Checking a checkpoint against its ``checksums.json`` before it is resumed, on every rank.

Rank 0 reads the reference digests and the file sizes and sends them to all; the ranks then
split the hashing — each file to the rank with the fewest bytes so far, largest files first —
so the check costs about (checkpoint bytes / ranks) of hashing per rank, and every rank learns
every verdict. A checkpoint saved before goodput wrote checksums cannot be verified: the caller
is told (``expected`` is None) and decides. Nothing is written.
"""

from __future__ import annotations

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
    seconds: float


def verify_checkpoint(directory: Path) -> Verdict:
    """Collective over every rank: does ``directory`` hold the bytes its checksums name?"""
    start = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    reference: list[Any] = [None]
    if rank == 0:
        reference[0] = _reference(directory)
    dist.broadcast_object_list(reference, src=0)
    if reference[0] is None:
        return Verdict(False, None, 0, time.perf_counter() - start)
    if isinstance(reference[0], str):  # checksums.json itself is broken
        return Verdict(True, reference[0], 0, time.perf_counter() - start)
    expected, sizes = reference[0]
    share = assign(sizes, world_size)[rank]
    problem = first_mismatch(directory, {name: expected[name] for name in share})
    problems: list[Any] = [None] * world_size
    dist.all_gather_object(problems, problem)
    found = next((p for p in problems if p is not None), None)
    return Verdict(True, found, sum(sizes.values()), time.perf_counter() - start)


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
