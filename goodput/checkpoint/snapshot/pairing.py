"""Who holds whose in-memory checkpoint, and the newest step every rank can load.

A rank's partner copy lives on the next host (cyclic), at the same local index (``Pairing``):
a lost host's snapshots are on the host after it. None on one host, or when hosts hold unequal
numbers of ranks (``hosts_shape``). ``newest_complete`` is the restart's choice over what every
rank holds: its own copies, or the copies its holder keeps of it. Pure: no process groups, no
files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
