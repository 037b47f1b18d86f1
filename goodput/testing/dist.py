"""Run a function on N gloo ranks on localhost: spawned processes, file rendezvous, hard timeout.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh interpreters (``spawn``:
nothing inherited from the test process), each joining one process group through a
``FileStore`` in a private temp directory (no port probing, so no races between parallel tests),
calls ``fn(rank, world_size, *args)`` and returns the per-rank results in rank order. If any rank
raises, the traceback of the first failing rank is re-raised in the parent; if the ranks are not
all done within ``timeout_s`` every rank is killed and ``TimeoutError`` names the stragglers.
``fn`` must be importable at module level (spawn pickles it by reference).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

COLLECTIVE_TIMEOUT_S = 60


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        # A rank whose fn has no collective could finish and close its sockets while a slower
        # peer is still inside gloo's connect handshake ("Connection closed by peer"): no rank
        # starts before all are connected.
        dist.barrier()
        try:
            # Plain pickle, not the queue's: torch would pass tensors as shared-memory file
            # descriptors that die with this process, racing the parent's read. (Our own child's
            # data: trusted.)
            results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="goodput-dist-") as tmp:
        store_path = str(Path(tmp) / "rendezvous")
        procs = [
            ctx.Process(
                target=_rank_main,
                name=f"rank{rank}",
                daemon=True,
                args=(fn, rank, world_size, store_path, args, results),
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(outcomes) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(outcomes))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f}s")
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [
                        p.name
                        for i, p in enumerate(procs)
                        if i not in outcomes and p.exitcode not in (None, 0)
                    ]
                    if dead:
                        raise RuntimeError(
                            f"{', '.join(dead)} died without a result "
                            "(killed by a signal or os._exit)"
                        ) from None
                    continue
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                outcomes[rank] = (ok, pickle.loads(value))
        finally:
            for proc in procs:
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return [outcomes[rank][1] for rank in range(world_size)]
