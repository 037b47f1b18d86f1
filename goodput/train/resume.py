"""Resuming a run: which checkpoint (``CheckpointChoice``), and loading it into the run's
registered contents (``resume``).

Rank 0 picks the checkpoint to resume from and tells the other ranks; an error there reaches
every rank, so no rank waits out the collective timeout. The choice is begun before the model is
built, so that the checkpoint's checksums are hashed meanwhile. With ``[checkpoint] local_dir``
each host then reads its node-local copy of that checkpoint instead, once the copy's checksums
match (``checkpoint.local_copy``). The load fills every parameter of a model built empty for it;
should every checkpoint found be refused after all, the model is initialised then, the values a
fresh build draws. The loader's position is one of the registered states (``LoaderState``).
"""

from __future__ import annotations

import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.load import (
    check_model_shape,
    config_diff,
    find_checkpoint,
    load_checkpoint,
    read_checkpoint,
)
from goodput.checkpoint.local_copy import choose_copy
from goodput.checkpoint.state import CheckpointContents
from goodput.checkpoint.verify import PendingVerification, Verdict
from goodput.config import to_toml
from goodput.data.loader import DataLoader
from goodput.errors import GoodputError
from goodput.rundir import checkpoints_dir
from goodput.train.config import RunConfig
from goodput.train.init import initialize_model
from goodput.train.setup import decided_by_rank_zero


@dataclass(frozen=True, slots=True)
class LoaderState:
    """The loader's position as the train state's ``loader`` entry (absent from a model-only
    checkpoint: the run starts at the first sample)."""

    loader: DataLoader
    allow_data_change: bool  # checkpoint.allow_data_change

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, train_state: Mapping[str, Any]) -> None:
        if "loader" in train_state:
            self.loader.load_state_dict(
                train_state["loader"], allow_data_change=self.allow_data_change
            )


def resume(
    cfg: RunConfig,
    choice: CheckpointChoice,
    contents: CheckpointContents,
    device: torch.device,
) -> int | None:
    """Load the checkpoint ``choice`` settles on, if any, into ``contents``; return the step it
    was saved at (0 for a model-only checkpoint), or None for a fresh start."""
    chosen = choice.finish()
    if chosen is None:
        if choice.found:  # the model was built empty for a checkpoint that was then refused
            initialize_model(contents.parts, cfg.model, cfg.train.seed)
        return None
    directory, copies = chosen
    saved, train_state = read_checkpoint(directory)
    current = tomllib.loads(to_toml(cfg))
    check_model_shape(directory, saved, current)
    if "loader" in train_state and dist.get_rank() == 0:  # not model-only
        for line in config_diff(saved, current):
            print(f"resume: config differs from the checkpoint's: {line}", flush=True)
    start = time.perf_counter()
    load_checkpoint(directory, contents, train_state, device)
    if dist.get_rank() == 0:
        print(
            f"resume: from {directory} (step {train_state['step']}) loaded in "
            f"{time.perf_counter() - start:.2f} s{copies}",
            flush=True,
        )
    step: int = train_state["step"]
    return step


@dataclass(slots=True)
class _Candidate:
    saved: Path  # the checkpoint as saved
    directory: Path  # the copy this rank reads: the saved one or its node-local copy
    notes: list[str]
    verification: PendingVerification | None  # None: nothing (more) to check


class CheckpointChoice:
    """Collective: which copy of which checkpoint this rank resumes from. Begun before the model
    is built, so the checksum hashing runs meanwhile; ``finish`` after. A checkpoint whose files
    do not match its checksums is refused by name; ``auto`` then falls back to the newest older
    complete one (checked without overlap: a rare path)."""

    def __init__(self, cfg: CheckpointConfig, root: Path) -> None:
        self.cfg, self.root = cfg, root
        self.refused: list[Path] = []
        self.candidate = self._next()
        self.found = self.candidate is not None  # so the model is built empty, for the load

    def _next(self) -> _Candidate | None:
        found = decided_by_rank_zero(
            lambda: _path_or_none(find_checkpoint(self.root, self.cfg.resume, self.refused))
        )
        if found is None:
            return None
        saved = Path(found)
        candidate = _Candidate(saved, saved, [], None)
        every_host_local = False
        if self.cfg.local_dir:
            copy = choose_copy(saved, Path(self.cfg.local_dir))
            candidate.directory = copy.directory
            every_host_local = copy.num_local_hosts == copy.num_hosts
            candidate.notes.append(
                f"node-local copy read on {copy.num_local_hosts} of {copy.num_hosts} "
                f"host(s), checksums checked in {copy.seconds:.2f} s"
            )
        if self.cfg.verify_checksums and not every_host_local:
            candidate.verification = PendingVerification(saved)
        return candidate

    def finish(self) -> tuple[Path, str] | None:
        """The copy to read and a note on how it was checked; None for a fresh start."""
        while (candidate := self.candidate) is not None:
            verdict = candidate.verification.result() if candidate.verification else None
            if verdict is None or verdict.problem is None:
                if verdict is not None:
                    candidate.notes.append(_describe(verdict))
                return candidate.directory, "".join(f"; {note}" for note in candidate.notes)
            if self.cfg.resume != "auto":
                raise GoodputError(
                    candidate.saved,
                    f"refused: {verdict.problem}",
                    "resume from another checkpoint (--resume auto takes the newest intact one)",
                )
            if dist.get_rank() == 0:
                print(
                    f"warning: refusing checkpoint {candidate.saved}: {verdict.problem}; "
                    "falling back to the newest older complete checkpoint",
                    flush=True,
                )
            self.refused.append(candidate.saved)
            self.candidate = self._next()
        return None


def _describe(verdict: Verdict) -> str:
    if not verdict.checksummed:
        return "not verified: it has no checksums.json (saved before goodput wrote them)"
    return (
        f"checksums of {verdict.num_bytes / 1e9:.2f} GB checked in {verdict.hashing_s:.2f} s "
        f"({verdict.waited_s:.2f} s of it not hidden behind the model build)"
    )


def checkpoint_root(cfg: RunConfig) -> Path:
    return (
        Path(cfg.checkpoint.folder) if cfg.checkpoint.folder else checkpoints_dir(cfg.train.run_dir)
    )


def _path_or_none(path: Path | None) -> str | None:
    return str(path) if path is not None else None
