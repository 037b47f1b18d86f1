"""The name of every file in a run directory (``train.run_dir``, ``goodput launch --run-dir``):
the contract between the trainer, the launcher, job chains and whatever reads a run afterwards,
and which checkpoints of a run exist and are complete. Standard library only: the launcher,
which never imports torch, spells the names from here too.

::

    RUN/
      config.toml            the resolved run config, written by rank 0 at start
      run.json               what produced the run; its presence makes a folder a run directory
      metrics.jsonl          one JSON line per step (rank 0), appended
      evals.jsonl            one JSON line per eval metric (the loop's evals, goodput eval)
      busy.jsonl             one JSON line per [watch] window: busy time over ranks (rank 0)
      heartbeat              {"step": N, "time": T}, replaced every step: the launcher's progress
      tensorboard/           the same scalars as event files
      attempts.jsonl         one line per launch attempt (goodput launch --run-dir)
      chain.sbatch|chain.pbs the job script of a goodput submit chain (and its jobs' logs)
      hostfile-<hash>        an attempt's hosts, one a line: srun, mpiexec and its ranks read it
      done                   empty, written last after the final step: a job chain stops here
      run-id                 16 hex digits naming this life of the run (rank 0, after a resume):
                             in-memory checkpoints of another life are never loaded
      checkpoints/
        step-00000100/
          .metadata  __<rank>_0.distcp  DCP: {"model": ..., "optim": ...} (model-only: no optim)
          config.toml                   the resolved run config (model-only: [model] alone)
          train_state.json              step, loader position and data fingerprint (rank 0)
          rng/rank-00000.json           every RNG of each rank
          checksums.json                SHA-256 of each file above, hashed by its writer
          .complete                     written last, by rank 0, once every rank is durable
        latest               "step-00000100", replaced only after its .complete exists

A checkpoint directory counts only with ``.complete``. ``enclosing`` tells whether a path lies
in a run directory or a checkpoint (for ``goodput.outputs``, the guard of every output path).
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from goodput.errors import GoodputError
from goodput.io import is_complete, read_text, write_text
from goodput.ranks import HEARTBEAT_VAR

CONFIG = "config.toml"
RUN_RECORD = "run.json"
METRICS = "metrics.jsonl"
EVALS = "evals.jsonl"
BUSY = "busy.jsonl"  # runfiles.BusyLine; train/monitor/stragglers.py writes it, the report draws it
# The bound every reader puts on one line of metrics.jsonl and evals.jsonl: a line is written at
# a few hundred bytes, so a longer one is damage, refused before it fills memory.
MAX_LINE_BYTES = 1 << 20
HEARTBEAT = "heartbeat"
TENSORBOARD = "tensorboard"
ATTEMPTS = "attempts.jsonl"
CHAIN_SCRIPTS = {"slurm": "chain.sbatch", "pbs": "chain.pbs"}
HOSTFILE_PREFIX = "hostfile-"
DONE = "done"
RUN_ID = "run-id"
RUN_ID_TEXT = re.compile(r"[0-9a-f]{16}")  # secrets.token_hex(8); matched whole
LR_FIND = "lr_find.json"  # goodput diagnose lr-find's curve, for the run's report
# What goodput launch, submit, diagnose lr-find and ckpt import/from-torch may put in a run
# directory before the trainer first starts.
LAUNCHER_FILES = re.compile(
    r"chain\.(sbatch|pbs)|.+-[0-9]+\.out|.+\.log|hostfile-[0-9a-f]{12}|attempts\.jsonl"
    r"|lr_find\.json|checkpoints"
)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAIN_STATE = "train_state.json"
METADATA = ".metadata"  # DCP's name for it
CHECKSUMS = "checksums.json"
RNG_DIR = "rng"
STEP_DIR = re.compile(r"step-(\d{8})")  # matched whole (fullmatch): no trailing newline
COMPLETE = ".complete"  # io.write_marker's default name
# The files any one of which makes a folder a run directory for goodput.outputs: what the
# trainer and goodput eval write. Not attempts.jsonl or heartbeat: goodput launch writes them
# into its --run-dir, by default the --log's folder, which may hold the trainer's run directory.
RUN_MARKERS = (RUN_RECORD, METRICS, EVALS)
RUN_DIRECTORY = "run directory"
CHECKPOINT = "checkpoint"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    path: Path
    complete: bool


def heartbeat_files(run_dir: str | Path, environ: Mapping[str, str]) -> list[Path]:
    """Where rank 0 writes the heartbeat: ``RUN/heartbeat``, and the launcher's file
    (``ranks.HEARTBEAT_VAR``) when that is another one: an absolute path of a file named
    ``heartbeat``. Rank 0 keeps both, so the launcher sees progress whatever train.run_dir is
    and wherever the step lines go. When the launcher's folder is not on this host (not shared
    with the launcher's), it is left out and the launcher has the step lines alone."""
    own = Path(run_dir) / HEARTBEAT
    named = environ.get(HEARTBEAT_VAR)
    if not named:
        return [own]
    launcher = Path(named)
    if not launcher.is_absolute() or launcher.name != HEARTBEAT:
        raise GoodputError.usage(
            f"${HEARTBEAT_VAR}",
            f"{named[:200]!r} is not the absolute path of a file named {HEARTBEAT!r}",
            "unset it: goodput launch sets it for its ranks",
        )
    try:
        here = launcher.parent.is_dir()
    except OSError:  # a name this file system cannot hold: not a folder here either
        here = False
    return [own, launcher] if here and launcher != own.absolute() else [own]


def run_id(run_dir: str | Path, *, fresh: bool) -> str:
    """The id of this life of the run: the one in ``RUN/run-id`` unless ``fresh`` (``resume``
    other than ``auto``: nothing of an earlier life may be loaded) or there is none yet, else a
    new one. A damaged file is a ``GoodputError`` naming it: guessing a new id would silently
    drop the in-memory checkpoints a restart is for."""
    path = Path(run_dir) / RUN_ID
    if fresh or not os.path.lexists(path):
        return secrets.token_hex(8)
    text = read_text(path, max_bytes=64).removesuffix("\n")
    if not RUN_ID_TEXT.fullmatch(text):
        raise GoodputError(
            path,
            "is not a run id (16 lowercase hex digits)",
            "delete it: the run then starts a new life and resumes from its disk checkpoint",
        )
    return text


def write_run_id(run_dir: str | Path, run_id: str) -> None:
    """Rank 0, once a start has resumed (or started fresh): later starts know this life."""
    write_text(Path(run_dir) / RUN_ID, run_id + "\n")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def rng_file(directory: Path, rank: int) -> Path:
    return directory / RNG_DIR / f"rank-{rank:05d}.json"


PROFILE = "profile"  # [profile]'s traces and out-of-memory snapshots (train/profiling.py)


def profile_trace(run_dir: str | Path, rank: int, first: int, last: int) -> Path:
    """A rank's Chrome trace of steps first-last; TensorBoard's profiler plugin lists files
    ending ``.pt.trace.json``, and Perfetto opens them."""
    return Path(run_dir) / PROFILE / f"rank-{rank:05d}.steps-{first}-{last}.pt.trace.json"


def oom_snapshot(run_dir: str | Path, rank: int) -> Path:
    """A rank's CUDA allocator snapshot at an out-of-memory error (pytorch.org/memory_viz)."""
    return Path(run_dir) / PROFILE / f"oom-rank-{rank:05d}.pickle"


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


def enclosing(path: Path) -> tuple[str, Path] | None:
    """The innermost run directory or checkpoint that ``path`` (absolute, links resolved) is or
    lies in, as ``(RUN_DIRECTORY or CHECKPOINT, folder)``; None when there is none.

    A checkpoint is a folder holding DCP's ``.metadata`` or a ``.complete`` marker (a blend's
    folder too: equally not to be written over), a ``step-N`` folder of a ``checkpoints``
    folder, or a folder whose ``latest`` names a ``step-N``. A run directory holds any of
    ``RUN_MARKERS``."""
    for folder in (path, *path.parents):
        if not folder.is_dir():
            continue
        if _is_checkpoint(folder):
            return CHECKPOINT, folder
        if any((folder / name).is_file() for name in RUN_MARKERS):
            return RUN_DIRECTORY, folder
    return None


def _is_checkpoint(folder: Path) -> bool:
    if (folder / METADATA).exists() or (folder / COMPLETE).exists():
        return True
    if STEP_DIR.fullmatch(folder.name) and folder.parent.name == CHECKPOINTS:
        return True
    latest = folder / LATEST
    if not latest.is_file() or latest.stat().st_size > 64:
        return False
    return STEP_DIR.fullmatch(latest.read_text(errors="replace").strip()) is not None


def foreign_files(folder: Path) -> list[str]:
    """What makes ``folder`` no run directory to write into: the names in it, sorted, unless it
    has ``run.json`` or holds only what launch, submit and lr-find put there first."""
    if (folder / RUN_RECORD).is_file():
        return []
    return sorted(p.name for p in folder.iterdir() if not LAUNCHER_FILES.fullmatch(p.name))
