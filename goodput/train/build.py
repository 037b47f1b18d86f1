"""The run's builders: ``build_run`` returns the parts the loop and lr-find share (``Run``),
each built from its config table, in the order they need.

Rank 0 checks that the run directory is ours to write (new, empty, or a goodput run directory),
builds the blend (a cache hit after the first run) and tells the other ranks; an error there
reaches every rank, so no rank waits out the collective timeout. The checkpoint to resume from
is chosen before the model is built (``resume.CheckpointChoice``); with ``[checkpoint]
memory_interval_steps`` the store of in-memory checkpoints (``checkpoint.snapshot``) is built
before that choice, which asks it first: rank 0 reads this life's run id from the run directory
(a new one unless ``resume = "auto"``; the loop writes it once the resume succeeded). Every
rank's host (``Run.hosts``, ``rank_hosts``), first: the snapshots' partner ranks and the
straggler watch's host names come from it.

The model is built on the meta device, laid out by ``parallelize`` (or cut into pipeline
stages) and only then allocated: each rank allocates and initialises its own shards
(``goodput.train.init``), whose values do not depend on the layout. When a checkpoint was found
to resume from, the init is skipped: the load overwrites every parameter (``resume.resume``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from goodput import __version__, rundir
from goodput.checkpoint.snapshot.store import SnapshotStore
from goodput.config import to_toml
from goodput.data.blend import BlendSpec, BlendStage, build_blend, format_report
from goodput.data.loader import DataLoader
from goodput.data.manifest import git_sha
from goodput.errors import GoodputError
from goodput.eval.config import EvalConfig
from goodput.eval.heldout import LoopEval
from goodput.faults import FaultPlan
from goodput.io import write_json, write_text
from goodput.outputs import RUN_DIR, check_output_dir
from goodput.ranks import every_rank_host, rank_host
from goodput.runfiles import stage_mixtures
from goodput.train.config.parallel import pipeline_microbatches
from goodput.train.config.run import BatchPlan, RunConfig, plan_batches
from goodput.train.flops import flops_per_token
from goodput.train.init import initialize_model
from goodput.train.metrics import Metrics
from goodput.train.model import Transformer
from goodput.train.monitor.diagnostics import measures_noise
from goodput.train.optim.optimizers import Optimizers, replica_group
from goodput.train.optim.sophia import label_generator
from goodput.train.parallel.grad_tally import GradientTally
from goodput.train.parallel.mesh import ParallelMesh, build_mesh
from goodput.train.parallel.parallelize import parallelize
from goodput.train.parallel.pipeline import Pipeline, build_pipeline, model_parts
from goodput.train.resume import CheckpointChoice, checkpoint_root
from goodput.train.ring_attention import ContextLayout
from goodput.train.setup import Runtime, decided_by_rank_zero
from goodput.train.step import StepSettings, micro_batches_of

RECORDED_PACKAGES = ("torch", "numpy", "sentencepiece", "tokenizers", "tensorboard")


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """The parts of one run on this rank that the loop and lr-find share, built by
    ``build_run``."""

    runtime: Runtime
    hosts: tuple[str, ...]  # every rank's host, by rank (rank_hosts: once, here)
    seed: int  # train.seed
    mesh: ParallelMesh
    plan: BatchPlan
    run_dir: Path
    loader: DataLoader
    loop_eval: LoopEval  # evaluates nothing for lr-find
    checkpoint_choice: CheckpointChoice  # finds nothing for lr-find
    snapshots: SnapshotStore | None  # [checkpoint] memory_interval_steps; None: off, lr-find
    model: nn.Module | Pipeline  # the whole model, or this rank's stages and their schedule
    parts: list[nn.Module]  # the modules this rank holds (one per pipeline stage)
    optimizer: Optimizers
    step_settings: StepSettings
    context: ContextLayout | None

    def micro_batches(
        self, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the global ``batch`` (under cp, its chunks of each sequence),
        on its device, in micro-batches."""
        return micro_batches_of(batch, self.context, self.mesh.cp_rank, self.plan, self.device)

    def hessian_labels(self, step: int) -> torch.Generator | None:
        """The generator of step ``step``'s sampled labels when SophiaG estimates its Hessian
        after it, else None."""
        if not self.optimizer.wants_hessian(step):
            return None
        return label_generator(self.seed, step, self.mesh, self.device)

    @property
    def device(self) -> torch.device:
        return self.runtime.device


def build_run(
    cfg: RunConfig, runtime: Runtime, *, trains: bool = True, faults: FaultPlan | None = None
) -> Run:
    """Build the run's shared parts in the order they need: refusals before the blend is built,
    the run directory checked before anything is written, the checkpoint chosen before the model
    is built (so its checksums are hashed meanwhile). ``trains`` False (lr-find): no metrics
    sinks, in-loop eval, gradient noise measurement or in-memory checkpoints, and a fresh model at
    the config's LR. ``faults``: goodput chaos's, for the snapshot store's fault hook."""
    hosts = rank_hosts(runtime)  # a collective only when goodput did not launch the ranks
    mesh = build_mesh(cfg.parallel, runtime.device, runtime.ranks_per_host)
    plan = plan_batches(cfg.train, dp_size=mesh.dp_size)
    if mesh.degrees.pp > 1:  # refused before the blend is built, not when the model is
        pipeline_microbatches(cfg.parallel, plan.local_batch_size, plan.grad_accumulation)
    run_dir = Path(cfg.train.run_dir)
    decided_by_rank_zero(lambda: require_run_dir(run_dir))  # before anything is written
    if trains:
        decided_by_rank_zero(cfg.metrics.check_sinks)  # wandb asked for is installed, or one line
    loader = build_loader(cfg, plan, mesh)
    # The held-out rows and the tasks, read and tokenized before anything is written.
    loop_eval = LoopEval(
        cfg.eval if trains else EvalConfig(),
        loader.samples,
        seq_len=cfg.train.seq_len,
        vocab_size=cfg.model.vocab_size,
    )
    # Chosen before the model is built, so its checksums are hashed meanwhile; an in-memory
    # checkpoint, when the ranks have one, before any checkpoint on disk.
    resumes = cfg.checkpoint if trains else replace(cfg.checkpoint, resume="never")
    snapshots = None
    if trains and cfg.checkpoint.memory_interval_steps:
        snapshots = build_snapshots(cfg, runtime, hosts, faults)
    choice = CheckpointChoice(
        resumes, checkpoint_root(cfg), memory=snapshots, last_step=cfg.train.steps
    )
    # Where the layout allows it, each rank's own gradient is measured on its way to the
    # data-parallel sum (the gradient noise scale's small batch).
    tally = GradientTally() if trains and measures_noise(cfg, mesh, plan) else None
    model = build_model(cfg, runtime.device, mesh, plan, empty=choice.found, tally=tally)
    parts = model_parts(model)
    optimizer = Optimizers(parts, cfg.optim, cfg.schedule.lr, replica_group(mesh))
    context = context_layout(cfg, mesh)
    settings = StepSettings(
        max_grad_norm=cfg.train.max_grad_norm,
        token_group=mesh.token_group,
        data_group=mesh.data_group,
        positions_t=context.positions(mesh.cp_rank).to(runtime.device) if context else None,
        sync_every_micro_batch=cfg.parallel.sync_every_micro_batch,
        tally=tally,
    )
    return Run(
        runtime=runtime,
        hosts=hosts,
        seed=cfg.train.seed,
        mesh=mesh,
        plan=plan,
        run_dir=run_dir,
        loader=loader,
        loop_eval=loop_eval,
        checkpoint_choice=choice,
        snapshots=snapshots,
        model=model,
        parts=parts,
        optimizer=optimizer,
        step_settings=settings,
        context=context,
    )


def rank_hosts(runtime: Runtime) -> tuple[str, ...]:
    """Every rank's host, by rank (``ranks.rank_host`` of each). Read from the attempt's host
    file when goodput launched the ranks, with no collective (gathering W names to each of W
    ranks is 4 MB a rank at 127,488); gathered, each rank saying its own, when something else
    started them (torchrun alone, a test harness)."""
    hosts = every_rank_host(runtime.world_size, os.environ)
    if hosts is not None:
        return hosts
    gathered = [rank_host(runtime.rank, os.environ)] * runtime.world_size
    if runtime.world_size > 1:
        dist.all_gather_object(gathered, gathered[runtime.rank])
    return tuple(gathered)


def build_snapshots(
    cfg: RunConfig, runtime: Runtime, hosts: tuple[str, ...], faults: FaultPlan | None
) -> SnapshotStore:
    """Collective: the in-memory checkpoint store of this life of the run (its run id, read by
    rank 0: a new one unless ``resume = "auto"``, so an earlier life's snapshots are never
    loaded), its partner ranks on the next host (``hosts``: every rank's)."""
    fresh = cfg.checkpoint.resume != "auto"
    return SnapshotStore(
        cfg.checkpoint,
        root=checkpoint_root(cfg),
        run_id=decided_by_rank_zero(lambda: rundir.run_id(cfg.train.run_dir, fresh=fresh)),
        config_digest=config_digest(cfg),
        hosts=hosts,
        rank=runtime.rank,
        device=runtime.device,
        faults=faults,
    )


def config_digest(cfg: RunConfig) -> str:
    """What an in-memory checkpoint must have been taken under to be loaded: the resolved config,
    but for ``resume`` (a restart's ``--resume`` does not change what was trained). Stricter than a
    checkpoint, which loads under another config and says how it differs: a snapshot serves a
    restart of the same run, and anything else resumes from disk."""
    same = replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto"))
    return hashlib.sha256(to_toml(same).encode()).hexdigest()


def build_metrics(cfg: RunConfig, run: Run, peak_flops_per_device: float | None) -> Metrics:
    """The step records (rank 0 writes them), against ``peak_flops_per_device`` for MFU."""
    return Metrics(
        run.run_dir,
        rank=run.runtime.rank,
        world_size=run.runtime.world_size,
        device=run.device,
        tokens_per_step=run.plan.global_batch_size * cfg.train.seq_len,
        flops_per_token=flops_per_token(cfg.model, cfg.train.seq_len),
        peak_flops_per_device=peak_flops_per_device,
        tensorboard=cfg.train.tensorboard,
        sinks=cfg.metrics,
    )


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
    """The blend a run of ``cfg`` trains on, sized for the whole run: one stage per data-mix
    stage, each from its first step's first sample (a step's samples all of one stage)."""
    stages = tuple(
        BlendStage(Path(file_list), start * plan.global_batch_size)
        for file_list, start in zip(cfg.data.file_lists(), cfg.stage_steps(), strict=True)
    )
    return BlendSpec(
        stages=stages,
        step_samples=plan.global_batch_size,
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
            cfg.data.file_list or "[data] stages",
            f"the tokenizer's vocabulary ({tokenizer['vocab_size']}) is larger than "
            f"model.vocab_size ({cfg.model.vocab_size})",
            f"set model.vocab_size to at least {tokenizer['vocab_size']}",
        )


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
            cfg.model,
            cfg.parallel,
            mesh,
            device,
            num_microbatches=microbatches,
            context=context_layout(cfg, mesh),
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


def write_run_record(run: Run, cfg: RunConfig, peak_flops: float | None, peak_source: str) -> None:
    """The resolved config and what produced the run, written once at start by rank 0 (once
    the resume succeeded: a refused one leaves the run directory as it was), and the run id of
    this life when it takes in-memory checkpoints."""
    run_dir, loader = run.run_dir, run.loader
    write_text(run_dir / rundir.CONFIG, to_toml(cfg))
    if run.snapshots is not None:
        rundir.write_run_id(run_dir, run.snapshots.run_id)
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
            "world_size": run.runtime.world_size,
            "device": str(run.device),
            "peak_flops_per_device": peak_flops,
            "peak_flops_source": peak_source,
            "data": {
                "blend": str(loader.samples.directory),
                "fingerprint": manifest["fingerprint"],
                "components": manifest["components"],
                "stages": [
                    stage.as_json()
                    for stage in stage_mixtures(manifest, run.plan.global_batch_size)
                ],
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
