"""Where a checkpoint's parts live, and which checkpoints of a run exist and are complete.

::

    RUN/checkpoints/
      step-00000100/
        .metadata  __<rank>_0.distcp   DCP: {"model": ..., "optim": ...} (model-only: no optim)
        config.toml                     the resolved run config (model-only: [model] alone)
        train_state.json                step, loader position and data fingerprint (rank 0)
        rng/rank-00000.json             every RNG of each rank
        checksums.json                  SHA-256 of each file above, hashed by its writer (rank 0)
        .complete                       written last, by rank 0, once every rank is durable
      latest                            "step-00000100", replaced only after .complete exists

A directory counts only with ``.complete``. Nothing here imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from goodput.io import is_complete

CHECKPOINTS = "checkpoints"
LATEST = "latest"
CONFIG = "config.toml"
TRAIN_STATE = "train_state.json"
METADATA = ".metadata"  # DCP's name for it
CHECKSUMS = "checksums.json"
RNG_DIR = "rng"
STEP_DIR = re.compile(r"step-(\d{8})")  # matched whole (fullmatch): no trailing newline


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    path: Path
    complete: bool


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def rng_file(directory: Path, rank: int) -> Path:
    return directory / RNG_DIR / f"rank-{rank:05d}.json"


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """Every ``step-N`` directory under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found.append(Checkpoint(int(match.group(1)), path, is_complete(path)))
    return sorted(found, key=lambda c: c.step)
