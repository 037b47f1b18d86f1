"""Ranks as threads of one process, for tests of what every rank computes from the step's
``Wire`` (``train.monitor.wire``): ``in_lockstep(body, world_size)`` runs ``body(wire)`` once per
rank, each in its own thread, and each ``reduce`` waits for every rank's, as a collective does.
The real wire is tested on real gloo ranks beside it (tests/unit/train/test_step_vote.py); this
one makes a world of 64 ranks cost milliseconds."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from goodput.train.monitor.wire import Op

T = TypeVar("T")
TIMEOUT_S = 60.0  # a body that skips a reduce on one rank fails the test instead of hanging it


class _Exchange:
    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=TIMEOUT_S)
        self.parts: list[list[int]] = [[] for _ in range(world_size)]
        self.sent: list[tuple[int, str, int]] = []  # (rank, op, integers) of every reduce


class ThreadWire:
    """One rank's end of the exchange (a ``goodput.train.monitor.wire.Wire``)."""

    def __init__(self, exchange: _Exchange, rank: int, world_size: int) -> None:
        self.exchange, self.rank, self.world_size = exchange, rank, world_size

    def reduce(self, values: Sequence[int], op: Op, site: str) -> list[int]:
        exchange = self.exchange
        exchange.parts[self.rank] = list(values)
        exchange.sent.append((self.rank, op, len(values)))
        exchange.barrier.wait()
        combine = sum if op == "sum" else max
        lengths = {len(part) for part in exchange.parts}
        assert len(lengths) == 1, f"ranks reduced different lengths at {site}: {lengths}"
        result = [combine(column) for column in zip(*exchange.parts, strict=True)]
        exchange.barrier.wait()  # everyone has read before anyone writes the next
        return result


def in_lockstep(
    body: Callable[[ThreadWire], T], world_size: int
) -> tuple[list[T], list[tuple[int, str, int]]]:
    """``body``'s result of every rank, by rank, and every reduce sent (rank, op, integers)."""
    exchange = _Exchange(world_size)
    results: list[T | None] = [None] * world_size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(ThreadWire(exchange, rank, world_size))
        except BaseException as error:  # handed to the test below, with the barrier broken
            errors.append(error)
            exchange.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results, exchange.sent  # type: ignore[return-value]
