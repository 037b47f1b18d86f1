"""Builders the loop calls in order: each turns its config table into one ready object.

Rank 0 checks that the run directory is ours to write (new, empty, or a goodput run directory),
builds the blend (a cache hit after the first run) and picks the checkpoint to resume from, and
tells the other ranks; an error there reaches every rank, so no rank waits out the collective
timeout. With ``[checkpoint] local_dir`` each host then reads its node-local copy of
that checkpoint instead, once the copy's checksums match (``checkpoint.local_copy``).

The model is built on the meta device, laid out by ``parallelize`` (or cut into pipeline
stages) and only then allocated: each rank allocates and initialises its own shards
(``goodput.train.init``), whose values do not depend on the layout. When a checkpoint was found
to resume from, the init is skipped: the load overwrites every parameter. Should every
checkpoint found be refused after all, the init runs then, the values a fresh build draws.
"""

from __future__ import annotations

import importlib.metadata
import math
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from goodput import __version__, rundir
from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.load import (
    check_model_shape,
    config_diff,
    find_checkpoint,
    load_checkpoint,
    read_checkpoint,
)
from goodput.checkpoint.local_copy import choose_copy
from goodput.checkpoint.verify import PendingVerification, Verdict
from goodput.config import to_toml
from goodput.data.blend import BlendSpec, build_blend, format_report
from goodput.data.loader import DataLoader
from goodput.data.manifest import git_sha
from goodput.errors import GoodputError
from goodput.eval.gate import EvalGate
from goodput.io import write_json, write_text
from goodput.outputs import RUN_DIR, check_output_dir
from goodput.rundir import checkpoints_dir
from goodput.train.config import BatchPlan, RunConfig
from goodput.train.grad_tally import GradientTally
from goodput.train.init import initialize_model
from goodput.train.mesh import ParallelMesh
from goodput.train.model import Transformer
from goodput.train.optim import Optimizers
from goodput.train.parallel_config import pipeline_microbatches
from goodput.train.parallelize import parallelize
from goodput.train.pipeline import Pipeline, build_pipeline
from goodput.train.ring_attention import ContextLayout
from goodput.train.watch import Watch

RECORDED_PACKAGES = ("torch", "numpy", "sentencepiece", "tokenizers", "tensorboard")
# What goodput launch and goodput submit put into a run directory before its trainer first
# starts: the job chain's script, Slurm's job logs (<job-name>-<id>.out), a launch --log, PBS
# host files and the attempts log. The trainer writes none of these names, so it overwrites none.


def decided_by_rank_zero(decide: Callable[[], Any]) -> Any:
    """Run ``decide`` on rank 0 only and hand its result — or its GoodputError, so that no rank
    waits out the collective timeout — to every rank."""
    found: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            found[0] = decide()
        except GoodputError as error:
            found[0] = error
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)  # our own ranks' str/None/GoodputError
    if isinstance(found[0], GoodputError):
        raise found[0]
    return found[0]


def require_run_dir(run_dir: Path) -> None:
    """Refuse a run directory that is not ours (``goodput.outputs.RUN_DIR``): it must be absent,
    empty, a goodput run directory or hold only what goodput's launch and submit put there
    first, and lie in no other run or checkpoint. Training into anything else would overwrite
    (config.toml) or mix with someone's files."""
    check_output_dir(run_dir, RUN_DIR, "train.run_dir")


def build_loader(cfg: RunConfig, plan: BatchPlan, mesh: ParallelMesh) -> DataLoader:
    """Build (rank 0) or find the blend sized for the whole run, and open the loader of this
    rank's data-parallel share."""

    def build() -> str:
        blend_dir, manifest = build_blend(blend_spec(cfg, plan))
        print(format_report(blend_dir, manifest), flush=True)
        return str(blend_dir)

    loader = DataLoader(
        decided_by_rank_zero(build),
        global_batch_size=plan.global_batch_size,
        dp_rank=mesh.dp_rank,
        dp_size=plan.dp_size,
        hash_index=False,  # build_blend on rank 0 has just checked (or written) the hashes
    )
    check_tokenizer_fits(cfg, loader.samples.manifest)
    return loader


def blend_spec(cfg: RunConfig, plan: BatchPlan) -> BlendSpec:
    """The blend a run of ``cfg`` trains on, sized for the whole run."""
    return BlendSpec(
        file_list=Path(cfg.data.file_list),
        seq_len=cfg.train.seq_len,
        num_samples=cfg.train.steps * plan.global_batch_size,
        seed=cfg.data.seed,
        cache=Path(cfg.data.cache),
        on_exhausted=cfg.data.on_exhausted,
        holdout_samples=cfg.eval.holdout_samples,
    )


def check_tokenizer_fits(cfg: RunConfig, manifest: dict[str, Any]) -> None:
    """Refuse a blend whose tokenizer has ids the model has no embedding for."""
    tokenizer = manifest.get("tokenizer")
    if tokenizer and tokenizer["vocab_size"] > cfg.model.vocab_size:
        raise GoodputError.usage(
            cfg.data.file_list,
            f"the tokenizer's vocabulary ({tokenizer['vocab_size']}) is larger than "
            f"model.vocab_size ({cfg.model.vocab_size})",
            f"set model.vocab_size to at least {tokenizer['vocab_size']}",
        )


def resume(
    cfg: RunConfig,
    choice: CheckpointChoice,
    parts: list[nn.Module],
    optimizers: Optimizers,
    loader: DataLoader,
    device: torch.device,
) -> dict[str, Any] | None:
    """Load the checkpoint ``choice`` settles on, if any; return its train state (``step``: the
    step it was saved at, 0 for a model-only checkpoint), or None for a fresh start."""
    chosen = choice.finish()
    if chosen is None:
        if choice.found:  # the model was built empty for a checkpoint that was then refused
            initialize_model(parts, cfg.model, cfg.train.seed)
        return None
    directory, copies = chosen
    saved, train_state = read_checkpoint(directory)
    Watch.check_state(train_state, directory / rundir.TRAIN_STATE)
    EvalGate.check_state(train_state, directory / rundir.TRAIN_STATE)
    current = tomllib.loads(to_toml(cfg))
    check_model_shape(directory, saved, current)
    if "loader" in train_state:
        if dist.get_rank() == 0:
            for line in config_diff(saved, current):
                print(f"resume: config differs from the checkpoint's: {line}", flush=True)
        loader.load_state_dict(
            train_state["loader"], allow_data_change=cfg.checkpoint.allow_data_change
        )
    start = time.perf_counter()
    load_checkpoint(directory, parts, optimizers.optimizers, train_state, device)
    if dist.get_rank() == 0:
        print(
            f"resume: from {directory} (step {train_state['step']}) loaded in "
            f"{time.perf_counter() - start:.2f} s{copies}",
            flush=True,
        )
    return train_state


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


def build_model(
    cfg: RunConfig,
    device: torch.device,
    mesh: ParallelMesh,
    plan: BatchPlan,
    *,
    empty: bool,
    tally: GradientTally | None = None,
) -> nn.Module | Pipeline:
    """The model on ``device``, laid out on ``mesh`` — this rank's pipeline stages and their
    schedule when ``pp`` > 1. Built on the meta device and laid out there, so that only this
    rank's shards are ever allocated; then initialised shard by shard (``goodput.train.init``),
    or, ``empty``, left for a load that fills every parameter. ``tally``: where FSDP's
    reduce-scatters add up each rank's own gradient."""
    if mesh.degrees.pp > 1:
        microbatches = pipeline_microbatches(
            cfg.parallel, plan.local_batch_size, default=plan.grad_accumulation
        )
        pipeline = build_pipeline(
            cfg.model, cfg.parallel, mesh, device, num_microbatches=microbatches
        )
        if not empty:
            initialize_model(pipeline.parts, cfg.model, cfg.train.seed)
        return pipeline
    with torch.device("meta"):
        transformer = Transformer(cfg.model)
    # In place: the same module.
    model = parallelize(
        transformer, cfg.parallel, mesh, context=context_layout(cfg, mesh), tally=tally
    )
    transformer.allocate(device)
    if not empty:
        initialize_model([transformer], cfg.model, cfg.train.seed)
    return model


def context_layout(cfg: RunConfig, mesh: ParallelMesh) -> ContextLayout | None:
    """How context parallelism splits each training sequence; None without it."""
    if mesh.degrees.cp == 1:
        return None
    return ContextLayout(cfg.train.seq_len, mesh.degrees.cp)


def micro_batches_of(
    batch: tuple[torch.Tensor, torch.Tensor],
    context: ContextLayout | None,
    cp_rank: int,
    plan: BatchPlan,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the global batch (under context parallelism its chunks of each
    sequence), on ``device``, in micro-batches."""
    input_ids, labels = batch
    if context is not None:
        input_ids, labels = (context.split(t, cp_rank) for t in (input_ids, labels))
    return list(
        zip(
            input_ids.to(device).split(plan.micro_batch_size),
            labels.to(device).split(plan.micro_batch_size),
            strict=True,
        )
    )


def write_run_record(
    run_dir: Path,
    cfg: RunConfig,
    loader: DataLoader,
    world_size: int,
    device: str,
    peak_flops: float | None,
    peak_source: str,
) -> None:
    """The resolved config and what produced the run, written once at start by rank 0."""
    write_text(run_dir / rundir.CONFIG, to_toml(cfg))
    versions = {}
    for package in RECORDED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    manifest = loader.samples.manifest
    write_json(
        run_dir / rundir.RUN_RECORD,
        {
            "goodput": __version__,
            "git_sha": git_sha(),
            "python": sys.version.split()[0],
            "packages": versions,
            "command": sys.argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world_size": world_size,
            "device": device,
            "peak_flops_per_device": peak_flops,
            "peak_flops_source": peak_source,
            "data": {
                "blend": str(loader.samples.directory),
                "fingerprint": manifest["fingerprint"],
                "components": manifest["components"],
            },
        },
    )


def fresh_loss_warning(loss: float, vocab_size: int, tolerance: float = 0.1) -> str | None:
    """A freshly initialised model predicts nearly uniformly, so its first loss is ~ln(vocab);
    far from it means a broken init, wrong labels or a wrong loss reduction."""
    expected = math.log(vocab_size)
    if abs(loss - expected) <= tolerance * expected:
        return None
    return (
        f"warning: step-1 loss {loss:.4f} is far from ln(vocab_size) = {expected:.4f} "
        f"(vocab {vocab_size}); check the init scale, the labels and the loss reduction"
    )
