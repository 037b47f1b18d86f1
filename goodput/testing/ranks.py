"""Real ``python -m goodput train`` processes for tests: one run on one rank, or the ranks of
one run started by hand, each with the environment a launcher would give it and one rank per
(emulated) host (``LOCAL_WORLD_SIZE=1``: rank R on host R, named by the host file of
``launched_on`` when the caller's ``env`` has it). Started through ``subprocess.Popen`` looked
up at each call, so a test's fixture that records every process it started sees these too."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from goodput.launch.launchers import free_port, write_hosts
from goodput.ranks import HOSTFILE_VAR


def start(
    config: Path,
    env: Mapping[str, str],
    *overrides: str,
    rank: int | None = None,
    world_size: int = 1,
    port: int | None = None,
) -> subprocess.Popen[str]:
    """``goodput train config *overrides`` with ``env`` on top of this process's environment;
    ``rank`` given: as rank ``rank`` of ``world_size`` meeting rank 0 on ``port``."""
    rank_env = {}
    if rank is not None:
        rank_env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "1",  # one rank per (emulated) host: rank R on host R
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    return subprocess.Popen(
        [sys.executable, "-m", "goodput", "train", str(config), *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env, **rank_env},
    )


def start_ranks(
    config: Path, env: Mapping[str, str], *overrides: str, world_size: int = 2
) -> list[subprocess.Popen[str]]:
    """Every rank of one run of ``config`` (``overrides`` on each), by rank."""
    port = free_port()
    return [
        start(config, env, *overrides, rank=r, world_size=world_size, port=port)
        for r in range(world_size)
    ]


def launched_on(folder: Path, hosts: Sequence[str]) -> dict[str, str]:
    """The variable ``goodput launch`` gives its ranks for an attempt on ``hosts``, its host file
    written in ``folder`` as the launcher writes it: ranks started with it name their hosts as
    launched ranks do (with ``LOCAL_WORLD_SIZE``, which ``start`` sets for a rank)."""
    return {HOSTFILE_VAR: str(write_hosts(folder, hosts))}
