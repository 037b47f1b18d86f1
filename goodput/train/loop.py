"""The training loop: one function, top to bottom, from a run config to the last step.

Setup (process group, mesh, batch plan, data, model, optimizer, metrics) comes from small
builders; everything after that is here, in the order it happens. Each step, in labelled
blocks: LR; batch (this rank's slice of the global batch — under context parallelism its chunks
of each sequence — cut into micro-batches); step
(``train_step``, which skips the optimizer step on a non-finite gradient norm); metrics (and the
step-1 loss of a fresh model against ln(vocab)); eval, every ``[eval] interval_steps``
(``goodput.eval.heldout``: held-out loss per corpus and multiple-choice tasks, timed apart
from the step) and the eval gate (``goodput.eval.gate``), whose alarm can stop the run; the
non-finite guard (``train.max_skipped_steps``
skips in a row stop the run); checkpoint/terminate (``Checkpointer.decide``, the same on every
rank); injected faults, when ``goodput chaos`` set ``GOODPUT_FAULTS`` (``goodput.faults``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist

from goodput import rundir
from goodput.checkpoint.save import Checkpointer
from goodput.config import to_toml
from goodput.errors import ExitCode, GoodputError
from goodput.eval.gate import EvalGate
from goodput.eval.heldout import LoopEval
from goodput.eval.records import append_evals
from goodput.faults import load_plan
from goodput.io import write_marker
from goodput.progress import print_line
from goodput.train.build import (
    CheckpointChoice,
    build_loader,
    build_model,
    checkpoint_root,
    context_layout,
    decided_by_rank_zero,
    fresh_loss_warning,
    micro_batches_of,
    require_run_dir,
    resume,
    write_run_record,
)
from goodput.train.config import RunConfig, plan_batches
from goodput.train.flops import flops_per_token
from goodput.train.grad_tally import GradientTally
from goodput.train.mesh import build_mesh
from goodput.train.metrics import Metrics, peak_flops
from goodput.train.optim import Optimizers
from goodput.train.parallel_config import pipeline_microbatches
from goodput.train.parallelize import compute_dtype
from goodput.train.pipeline import model_parts
from goodput.train.schedule import learning_rate
from goodput.train.setup import setup_torch
from goodput.train.step import SkippedSteps, train_step
from goodput.train.termination import SigtermFlag
from goodput.train.watch import (
    LrScale,
    Watch,
    label_generator,
    measures_noise,
    replica_group,
)


def train(cfg: RunConfig) -> list[float]:
    """Run ``cfg`` on this rank; return the per-step losses (the same on every rank)."""
    entered = time.perf_counter()  # start-up: from here to the first step (the report's)
    owns_process_group = not dist.is_initialized()
    faults = load_plan(os.environ)  # None unless goodput chaos injects faults into this run
    runtime = setup_torch(seed=cfg.train.seed)
    rank, device = runtime.rank, runtime.device
    try:
        if faults is not None:  # a fault that could never fire: refused on every rank alike
            faults.check_reachable(
                world_size=runtime.world_size,
                steps=cfg.train.steps,
                saves=bool(cfg.checkpoint.interval_steps or cfg.checkpoint.interval_minutes),
            )
        mesh = build_mesh(cfg.parallel, device, runtime.ranks_per_host)
        plan = plan_batches(cfg.train, dp_size=mesh.dp_size)
        if mesh.degrees.pp > 1:  # refused before the blend is built, not when the model is
            pipeline_microbatches(cfg.parallel, plan.local_batch_size, plan.grad_accumulation)
        run_dir = Path(cfg.train.run_dir)
        decided_by_rank_zero(lambda: require_run_dir(run_dir))  # before anything is written
        decided_by_rank_zero(cfg.metrics.check_sinks)  # wandb asked for is installed, or one line
        loader = build_loader(cfg, plan, mesh)
        # The held-out rows and the tasks, read and tokenized before anything is written.
        loop_eval = LoopEval(
            cfg.eval, loader.samples, seq_len=cfg.train.seq_len, vocab_size=cfg.model.vocab_size
        )
        # Chosen before the model is built, so its checksums are hashed meanwhile.
        checkpoint_choice = CheckpointChoice(cfg.checkpoint, checkpoint_root(cfg))
        # Where the layout allows it, each rank's own gradient is measured on its way to the
        # data-parallel sum (the gradient noise scale's small batch).
        tally = GradientTally() if measures_noise(cfg, mesh, plan) else None
        # The whole model, or this rank's pipeline stages and their schedule; parts: the
        # modules this rank holds (one per stage).
        model = build_model(cfg, device, mesh, plan, empty=checkpoint_choice.found, tally=tally)
        parts = model_parts(model)
        optimizer = Optimizers(parts, cfg.optim, cfg.schedule.lr, replica_group(mesh))
        checkpointer = Checkpointer(cfg.checkpoint, checkpoint_root(cfg), device, faults)
        # Before anything is written: a refused resume must leave the run directory as it was.
        load_start = time.perf_counter()
        resumed = resume(cfg, checkpoint_choice, parts, optimizer, loader, device)
        # Where this start's time went, for the first step's record (goodput report).
        timings = {"checkpoint_load_s": time.perf_counter() - load_start} if resumed else {}
        start_step = resumed["step"] if resumed else 0
        skips = SkippedSteps.resumed(cfg.train.max_skipped_steps, resumed)
        lr_scale = LrScale.resumed(cfg, resumed)
        watch = Watch(cfg, parts, mesh, resumed, measures_noise=tally is not None)
        gate = EvalGate.resumed(cfg.eval.alarm_evals, cfg.eval.stop_on_alarm, resumed)
        peak, peak_source = peak_flops(device, compute_dtype(cfg.parallel), cfg.train.peak_tflops)
        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_run_record(
                run_dir, cfg, loader, runtime.world_size, str(device), peak, peak_source
            )
            print(
                f"train: {runtime.world_size} rank(s) on {device}, global batch "
                f"{plan.global_batch_size} x {cfg.train.seq_len} tokens = micro-batch "
                f"{plan.micro_batch_size} x {plan.grad_accumulation} accumulation x "
                f"{plan.dp_size} data-parallel",
                flush=True,
            )
            print(f"train: layout {mesh.degrees.describe()}", flush=True)
            peak_text = f"{peak / 1e12:.3f} TFLOP/s" if peak else "unknown"
            print(f"train: peak per device for MFU {peak_text} ({peak_source})", flush=True)
            for line in [lr_scale.describe(), watch.describe(), loop_eval.describe()]:
                if line:
                    print(line, flush=True)
        metrics = Metrics(
            run_dir,
            rank=rank,
            world_size=runtime.world_size,
            device=device,
            tokens_per_step=plan.global_batch_size * cfg.train.seq_len,
            flops_per_token=flops_per_token(cfg.model, cfg.train.seq_len),
            peak_flops_per_device=peak,
            tensorboard=cfg.train.tensorboard,
            sinks=cfg.metrics,
        )
        config_toml = to_toml(cfg)
        context = context_layout(cfg, mesh)
        positions_t = context.positions(mesh.cp_rank).to(device) if context else None
        losses = []
        batches = iter(loader)
        last_step_end = time.perf_counter()
        timings["startup_s"] = last_step_end - entered
        with SigtermFlag() as sigterm:
            for step in range(start_step + 1, cfg.train.steps + 1):
                # LR
                lr = lr_scale.factor * learning_rate(cfg.schedule, step - 1, cfg.train.steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                # Batch: this rank's share of the global batch (under cp, its chunks of each
                # sequence), in micro-batches.
                data_start = time.perf_counter()
                micro_batches = micro_batches_of(next(batches), context, mesh.cp_rank, plan, device)
                timings["data_time_s"] = time.perf_counter() - data_start
                # Step
                result = train_step(
                    model,
                    optimizer,
                    micro_batches,
                    max_grad_norm=cfg.train.max_grad_norm,
                    token_group=mesh.token_group,
                    positions_t=positions_t,
                    sync_every_micro_batch=cfg.parallel.sync_every_micro_batch,
                    tally=tally,
                    freeze=watch.freeze_check(step),
                    hessian_labels=(
                        label_generator(cfg.train.seed, step, mesh, device)
                        if optimizer.wants_hessian(step)
                        else None
                    ),
                    inject_nan=faults is not None and faults.nan_at(step, rank),
                )
                watch.clip_logits()  # QK-clip, when on: heads whose logits grew past it
                # Metrics: the whole iteration (data, step, logging, checkpoint stall) is the
                # step time; then the diagnostics and their warnings.
                now = time.perf_counter()
                too_many_skips = skips.count(step, result.skipped)
                diagnosed = watch.after_step(step, result, optimizer) | timings
                timings = {}
                # Eval: every [eval] interval_steps, all ranks, forward only; timed apart.
                evaluated = None
                if loop_eval.due(step, cfg.train.steps):
                    eval_start = time.perf_counter()
                    evaluated = loop_eval.evaluate(
                        model, mesh=mesh, plan=plan, context=context,
                        positions_t=positions_t, device=device,
                    )  # fmt: skip
                    diagnosed |= evaluated.metrics()
                    diagnosed["eval_time_s"] = time.perf_counter() - eval_start
                alarm = gate.observe(
                    step, result.loss, frozen=watch.frozen,
                    tasks=evaluated.tasks if evaluated else None,
                )  # fmt: skip
                if alarm is not None:
                    diagnosed["eval_alarm"] = 1
                metrics.step(step, result, lr, now - last_step_end, skips.total, diagnosed)
                if rank == 0:
                    if evaluated is not None:
                        print_line(evaluated.describe(step))
                        append_evals(run_dir, step, evaluated.records(), source="train")
                    if alarm is not None:
                        print_line(alarm)
                # The eval's time is its own (eval_time_s), not the next step's.
                last_step_end = time.perf_counter() if evaluated else now
                losses.append(result.loss)
                if step == 1 and rank == 0 and resumed is None:  # a fresh model
                    warning = fresh_loss_warning(result.loss, cfg.model.vocab_size)
                    if warning:
                        print(warning, flush=True)
                # Non-finite guard: the same on every rank, since the norm is.
                if too_many_skips is not None:
                    checkpointer.close()  # a save in flight, of an earlier step, completes
                    raise too_many_skips
                # Checkpoint / terminate
                decision = checkpointer.decide(
                    step, last_step=cfg.train.steps, sigterm=sigterm.is_set()
                )
                if decision.saves:
                    train_state = {
                        "loader": loader.state_dict(),
                        "world_size": runtime.world_size,
                        **skips.state_dict(),
                        **lr_scale.state_dict(),
                        **watch.state_dict(),
                        **gate.state_dict(),
                    }
                    # Held training: part of the next step's time, said in its record.
                    timings["checkpoint_stall_s"] = checkpointer.save(
                        step,
                        parts,
                        optimizer.optimizers,
                        train_state,
                        config_toml,
                        blocking=decision.stops,
                    )
                if alarm is not None and gate.stop_on_alarm:
                    checkpointer.close()
                    raise gate.stop_error(step)
                if decision.stops:
                    checkpointer.close()
                    raise GoodputError(
                        "train",
                        f"terminated by SIGTERM after step {step}",
                        "resubmit: the run resumes from its newest complete checkpoint",
                        code=ExitCode.TERMINATED,
                    )
                if faults is not None:
                    faults.after_step(step, rank)
        checkpointer.close()
        metrics.close()
        if rank == 0:
            # Last, once every step has run: a `goodput submit` job chain stops at this file.
            write_marker(run_dir, rundir.DONE)
            print(f"train: done; metrics in {run_dir / 'metrics.jsonl'}", flush=True)
        return losses
    finally:
        if owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
