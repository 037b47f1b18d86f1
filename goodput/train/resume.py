"""Resuming a run: which checkpoint or in-memory checkpoint (``CheckpointChoice``), and loading it
into the run's registered contents (``resume``).

Rank 0 picks the checkpoint to resume from and tells the other ranks; an error there reaches
every rank, so no rank waits out the collective timeout. The choice is begun before the model is
built, so that the checkpoint's checksums are hashed meanwhile. With ``[checkpoint] local_dir``
each host then reads its node-local copy of that checkpoint instead, once the copy's checksums
match (``checkpoint.local_copy``). The load fills every parameter of a model built empty for it;
should every checkpoint found be refused after all, the model is initialised then, the values a
fresh build draws. The loader's position is one of the registered states (``LoaderState``).

With in-memory checkpoints (snapshots for short: ``[checkpoint] memory_interval_steps``,
``checkpoint.snapshot``) the ranks then vote on the newest snapshot step every rank has (its own
copy or its partner's), no older than that checkpoint: when there is one, the checkpoint is
neither copied nor hashed (a restart within a job pays none of it); only when the snapshot is
refused at load (a damaged copy on some rank and its partner's, a changed layout: one line) does
the checkpoint's check start, and the resume goes on from it without overlap. Where a start's
state came from is ``Resumed``: ``snapshot``, ``partner`` (some rank read its partner's copy) or
``checkpoint``.
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
from goodput.checkpoint.snapshot.restore import SnapshotRefused
from goodput.checkpoint.snapshot.store import SnapshotStore
from goodput.checkpoint.state import CheckpointContents
from goodput.checkpoint.verify import PendingVerification, Verdict
from goodput.config import to_toml
from goodput.data.loader import DataLoader
from goodput.errors import GoodputError
from goodput.rundir import STEP_DIR, checkpoints_dir
from goodput.train.config.run import RunConfig
from goodput.train.init import initialize_model
from goodput.train.setup import decided_by_rank_zero


@dataclass(frozen=True, slots=True)
class LoaderState:
    """The loader's position as the train state's ``loader`` entry (absent from a model-only
    checkpoint: the run starts at the first sample). A position must leave the steps the run
    has left to ``steps`` within the blend."""

    loader: DataLoader
    allow_data_change: bool  # checkpoint.allow_data_change
    steps: int  # train.steps

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, train_state: Mapping[str, Any]) -> None:
        if "loader" in train_state:
            self.loader.load_state_dict(
                train_state["loader"],
                allow_data_change=self.allow_data_change,
                steps_left=max(self.steps - train_state["step"], 0),
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Resumed:
    """Where a resumed start's state came from: the ``step`` it was saved at (0 for a model-only
    checkpoint) and its ``source``, one of ``runfiles.RESUMED_FROM`` (``partner``: some rank
    read its partner's copy)."""

    step: int
    source: str

    def measured(self, load_s: float) -> dict[str, float | int | str]:
        """The fields of the start's first step record (``runfiles.MEASURED``), with the
        ``load_s`` seconds the resume took."""
        return {"checkpoint_load_s": load_s, "resumed_from": self.source, "resumed_step": self.step}


def resume(
    cfg: RunConfig,
    choice: CheckpointChoice,
    contents: CheckpointContents,
    device: torch.device,
) -> Resumed | None:
    """Load the in-memory checkpoint or the checkpoint ``choice`` settles on, if any, into
    ``contents``; None for a fresh start."""
    restored = choice.restore_snapshot(contents)
    if restored is not None:
        return restored
    chosen = choice.finish()
    if chosen is None:
        if choice.found:  # built empty for a checkpoint or snapshot that was then refused
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
    return Resumed(step=train_state["step"], source="checkpoint")


@dataclass(slots=True)
class _Candidate:
    saved: Path  # the checkpoint as saved
    directory: Path  # the copy this rank reads: the saved one or its node-local copy
    notes: list[str]
    verification: PendingVerification | None  # None: nothing (more) to check


class CheckpointChoice:
    """Collective: which in-memory checkpoint, or which copy of which checkpoint, this rank resumes
    from. Begun before the model is built, so the checksum hashing runs meanwhile; ``finish``
    after. A checkpoint whose files do not match its checksums is refused by name; ``auto`` then
    falls back to the newest older complete one (checked without overlap: a rare path).
    ``memory`` (with ``last_step``, the run's last step): the snapshot store, asked first."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        root: Path,
        *,
        memory: SnapshotStore | None = None,
        last_step: int = 0,
    ) -> None:
        self.cfg, self.root, self.memory = cfg, root, memory
        self.refused: list[Path] = []
        self.candidate = self._find()
        self.snapshot_step: int | None = None  # the in-memory checkpoint the ranks agreed on
        if memory is not None:
            self.snapshot_step = memory.choose(_step_of(self.candidate), last_step)
        if self.snapshot_step is None:
            self._check(self.candidate)
        # So the model is built empty, for the load.
        self.found = self.candidate is not None or self.snapshot_step is not None

    def restore_snapshot(self, contents: CheckpointContents) -> Resumed | None:
        """Collective: load the in-memory checkpoint chosen into ``contents``; None when there is
        none, or when it is refused (its line, naming what the resume falls back to; that
        checkpoint's check starts now)."""
        if self.snapshot_step is None:
            return None
        assert self.memory is not None
        try:
            restored = self.memory.restore(self.snapshot_step, contents)
        except SnapshotRefused as refused:
            if dist.get_rank() == 0:
                fallback = self.candidate.saved if self.candidate else "a fresh start"
                print(f"{refused.line}; falling back to {fallback}", flush=True)
            self.snapshot_step = None
            self._check(self.candidate)
            return None
        if dist.get_rank() == 0:
            print(
                f"resume: from memory snapshot of step {restored.step} ({restored.from_partner} "
                f"rank(s) from a partner's copy) loaded in {restored.seconds:.2f} s",
                flush=True,
            )
        source = "partner" if restored.from_partner else "snapshot"
        return Resumed(step=restored.step, source=source)

    def _find(self) -> _Candidate | None:
        """The checkpoint rank 0 finds (told to every rank), not yet checked."""
        found = decided_by_rank_zero(
            lambda: _path_or_none(find_checkpoint(self.root, self.cfg.resume, self.refused))
        )
        return None if found is None else _Candidate(Path(found), Path(found), [], None)

    def _check(self, candidate: _Candidate | None) -> None:
        """Collective: choose ``candidate``'s copy to read and start hashing its checksums."""
        if candidate is None:
            return
        saved = candidate.saved
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
            self.candidate = self._find()
            self._check(self.candidate)
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


def _step_of(candidate: _Candidate | None) -> int | None:
    """The step of a ``step-N`` checkpoint (no in-memory checkpoint older than it is loaded); None
    for none, or a directory named otherwise (``resume = DIR``: a new life of the run, whose
    snapshots are all another life's anyway)."""
    match = STEP_DIR.fullmatch(candidate.saved.name) if candidate else None
    return int(match.group(1)) if match else None
