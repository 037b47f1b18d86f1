"""The training loop: one function, top to bottom, from a run config to the last step.

Setup comes from builders: ``build.build_run`` (mesh, batch plan, data, in-loop eval, the
checkpoint to resume from, model, optimizer, the step's settings), shared with lr-find; then the
loop's own state (the non-finite guard's count, the LR scaling, the diagnostics, the eval gate),
registered with the ``Checkpointer`` once with the model and optimizers (``CheckpointContents``:
what every save writes and a resume loads), the resume, and the metrics. Everything after that
is here, in the order it happens. Each step, in labelled blocks: LR; batch (this rank's slice
of the global batch — under context parallelism its chunks of each sequence — cut into
micro-batches), and where it lies: its data-mix stage and the run's tokens through it, both from
the loader's global sample count, so they carry on across resumes; step (``train_step``, which
skips the optimizer step on a non-finite gradient norm); metrics (and the step-1 loss of a fresh
model against ln(vocab)); eval, every ``[eval]
interval_steps`` (``goodput.eval.heldout``: held-out loss per corpus and multiple-choice tasks,
timed apart from the step) and the eval gate (``goodput.eval.gate``), whose alarm can stop the
run; the step's vote (``StepHooks.decide``: one all-reduce, ``step_vote``) and the checkpoint's
decision taken from it (``Checkpointer.decide``, the same on every rank); the vote also hands
every rank each rank's busy time for the straggler watch, whose fields join the step's metrics;
the non-finite guard (``train.max_skipped_steps`` skips in a row stop the run); the checkpoint
save or stop, and with ``GOODPUT_EVICT_STRAGGLERS=1`` and a straggler named, a last blocking
save and exit 4 so the launcher replaces its host. The work around the step (the beacon, busy
time, injected faults under ``goodput chaos``, the profiler, in-memory checkpoints) is
``step_hooks.StepHooks``'s. A stop (``stop``) lets a save in flight complete first.
"""

from __future__ import annotations

import os
import time
from typing import NoReturn, Protocol

import torch.distributed as dist

from goodput import beacon, rundir
from goodput.checkpoint.save import Checkpointer
from goodput.checkpoint.state import CheckpointContents
from goodput.config import to_toml
from goodput.errors import ExitCode, GoodputError
from goodput.eval.gate import EvalGate
from goodput.eval.records import append_evals
from goodput.faults import load_plan
from goodput.io import write_marker
from goodput.progress import print_line
from goodput.train.build import Run, build_metrics, build_run, fresh_loss_warning, write_run_record
from goodput.train.config.run import RunConfig
from goodput.train.config.schedule import learning_rate
from goodput.train.metrics import peak_flops
from goodput.train.monitor.diagnostics import Diagnostics
from goodput.train.optim.lr_scale import LrScale
from goodput.train.optim.qk_clip import QkClip
from goodput.train.parallel.parallelize import compute_dtype
from goodput.train.resume import LoaderState, checkpoint_root, resume
from goodput.train.setup import setup_torch
from goodput.train.step import SkippedSteps, train_step
from goodput.train.step_hooks import StepHooks, open_rank_beacon
from goodput.train.termination import SigtermFlag


def train(cfg: RunConfig) -> list[float]:
    """Run ``cfg`` on this rank; return the per-step losses (the same on every rank)."""
    entered = time.perf_counter()  # start-up: from here to the first step (the report's)
    owns_process_group = not dist.is_initialized()
    faults = load_plan(os.environ)  # None unless goodput chaos injects faults into this run
    runtime = setup_torch(seed=cfg.train.seed)
    rank, device = runtime.rank, runtime.device
    try:
        open_rank_beacon(runtime)  # where this rank is, for the launcher's hang forensics
        if faults is not None:  # a fault that could never fire: refused on every rank alike
            faults.check_reachable(
                world_size=runtime.world_size,
                steps=cfg.train.steps,
                saves=bool(cfg.checkpoint.interval_steps or cfg.checkpoint.interval_minutes),
                snapshots=bool(cfg.checkpoint.memory_interval_steps),
            )
        run = build_run(cfg, runtime, faults=faults)
        model, optimizer, mesh, run_dir = run.model, run.optimizer, run.mesh, run.run_dir
        # The loop's own state, in every checkpoint: registered with the checkpointer once,
        # what each save writes and a resume loads.
        skips = SkippedSteps(cfg.train.max_skipped_steps)
        lr_scale = LrScale(cfg)
        diagnostics = Diagnostics(cfg.diagnostics, run.parts, mesh, run.step_settings.tally)
        qk_clip = QkClip.when_on(cfg.optim.qk_clip, run.parts, mesh)
        gate = EvalGate(cfg.eval.alarm_evals, cfg.eval.stop_on_alarm)
        contents = CheckpointContents(
            parts=run.parts,
            optimizers=optimizer.optimizers,
            states={
                "loader": LoaderState(
                    run.loader, cfg.checkpoint.allow_data_change, cfg.train.steps
                ),
                "skips": skips,
                "lr_scale": lr_scale,
                "diagnostics": diagnostics.running,
                "eval_gate": gate,
            },
            config_toml=to_toml(cfg),
        )
        checkpointer = Checkpointer(cfg.checkpoint, checkpoint_root(cfg), device, contents, faults)
        # Before anything is written: a refused resume must leave the run directory as it was.
        load_start = time.perf_counter()
        resumed = resume(cfg, run.checkpoint_choice, contents, device)
        # Where this start's time and state came from, for the first step's record (report).
        timings: dict[str, float | int | str] = (
            {} if resumed is None else resumed.measured(time.perf_counter() - load_start)
        )
        peak, peak_source = peak_flops(device, compute_dtype(cfg.parallel), cfg.train.peak_tflops)
        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_run_record(run, cfg, peak, peak_source)  # and the run id, after the resume
            print_start(cfg, run, peak, peak_source, [lr_scale, diagnostics, qk_clip])
        metrics = build_metrics(cfg, run, peak)
        eval_every = cfg.eval.interval_steps  # 0: no in-loop evals
        losses = []
        batches = iter(run.loader)
        last_step_end = time.perf_counter()
        timings["startup_s"] = last_step_end - entered
        first_step = (resumed.step if resumed else 0) + 1
        decay_start = cfg.schedule.decay_start_step(cfg.stage_steps())
        with SigtermFlag() as sigterm, StepHooks(cfg, run, faults, first_step=first_step) as hooks:
            for step in range(first_step, cfg.train.steps + 1):
                hooks.start(step)
                # LR
                lr = lr_scale.factor * learning_rate(
                    cfg.schedule, step - 1, cfg.train.steps, decay_start
                )
                for group in optimizer.param_groups:
                    group["lr"] = lr
                # Batch: this rank's share of the global batch, in micro-batches.
                data_start = time.perf_counter()
                hooks.data(step)
                micro_batches = run.micro_batches(next(batches))
                # Where the step's samples lie: through them, the run's tokens; their stage.
                consumed = run.loader.consumed_samples
                tokens = consumed * cfg.train.seq_len
                stage = run.loader.samples.stage_of_sample(consumed - run.plan.global_batch_size)
                timings["data_time_s"] = time.perf_counter() - data_start
                # Step
                hooks.before_step(step)
                result = train_step(
                    model,
                    optimizer,
                    micro_batches,
                    run.step_settings,
                    freeze=diagnostics.freeze_check(step),
                    hessian_labels=run.hessian_labels(step),
                    inject_nan=faults is not None and faults.nan_at(step, rank),
                )
                # QK-clip, when on: heads whose logits grew past it; the largest, recorded.
                max_logit = qk_clip.apply() if qk_clip else None
                # Metrics: the whole iteration (data, step, logging, checkpoint stall) is the
                # step time; then the diagnostics and their warnings.
                now = time.perf_counter()
                too_many_skips = skips.count(step, result.skipped)
                diagnosed = diagnostics.after_step(step, result, optimizer, max_logit) | timings
                timings = {}
                # Eval: every [eval] interval_steps and after the last step, all ranks, forward
                # only; timed apart.
                evaluated = None
                if eval_every and (step % eval_every == 0 or step == cfg.train.steps):
                    eval_start = time.perf_counter()
                    with hooks.eval():
                        evaluated = run.loop_eval.evaluate(
                            model, mesh=mesh, plan=run.plan, context=run.context,
                            positions_t=run.step_settings.positions_t, device=device,
                        )  # fmt: skip
                    diagnosed |= evaluated.metrics()
                    diagnosed["eval_time_s"] = time.perf_counter() - eval_start
                alarm = gate.observe(
                    step, result.loss, frozen=diagnostics.frozen,
                    tasks=evaluated.tasks if evaluated else None,
                )  # fmt: skip
                if alarm is not None:
                    diagnosed["eval_alarm"] = 1
                # The step's vote: before the metrics, so rank 0's logging is no one's busy time.
                decision, busy = hooks.decide(
                    checkpointer, step, last_step=cfg.train.steps, sigterm=sigterm.is_set()
                )
                metrics.step(
                    step, result, lr, now - last_step_end, skips.total, diagnosed | busy,
                    stage=stage, tokens=tokens,
                )  # fmt: skip
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
                    stop(checkpointer, too_many_skips)
                # Checkpoint / terminate; or save and stop to replace a straggler's host.
                evicts = step < cfg.train.steps and hooks.evicts(decision)
                if decision.saves:
                    # Held training: part of the next step's time, said in its record.
                    held = checkpointer.save(step, blocking=decision.stops or evicts)
                    timings["checkpoint_stall_s"] = held
                hooks.snapshot(step, decision, checkpointer)  # in-memory checkpoints, when on
                if alarm is not None and gate.stop_on_alarm:
                    stop(checkpointer, gate.stop_error(step))
                if decision.stops:
                    stop(checkpointer, terminated(step))
                if evicts:
                    stop(checkpointer, hooks.stragglers.evicted(step))
                hooks.end(step)
        checkpointer.close()
        metrics.close()
        if rank == 0:
            # Last, once every step has run: a `goodput submit` job chain stops at this file.
            write_marker(run_dir, rundir.DONE)
            metrics.finished(cfg.train.steps)
            print(f"train: done; metrics in {run_dir / rundir.METRICS}", flush=True)
        return losses
    finally:
        beacon.current().close()
        if owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def print_start(
    cfg: RunConfig, run: Run, peak: float | None, peak_source: str, extras: list[Described | None]
) -> None:
    """Rank 0's banner: the batch, the layout, the peak that MFU is measured against, and what
    the loop's ``extras`` say of themselves (the LR scaling, diagnostics, QK-clip), the evals and
    the snapshots."""
    plan = run.plan
    print(
        f"train: {run.runtime.world_size} rank(s) on {run.device}, global batch "
        f"{plan.global_batch_size} x {cfg.train.seq_len} tokens = micro-batch "
        f"{plan.micro_batch_size} x {plan.grad_accumulation} accumulation x "
        f"{plan.dp_size} data-parallel",
        flush=True,
    )
    print(f"train: layout {run.mesh.degrees.describe()}", flush=True)
    if cfg.data.stages is not None:
        stages = enumerate(zip(cfg.stage_steps(), cfg.data.file_lists(), strict=True))
        said = [f"{index} after step {start:,} ({path})" for index, (start, path) in stages]
        print(f"train: data-mix stages {', '.join(said)}", flush=True)
    peak_text = f"{peak / 1e12:.3f} TFLOP/s" if peak else "unknown"
    print(f"train: peak per device for MFU {peak_text} ({peak_source})", flush=True)
    for extra in [*extras, run.loop_eval, run.snapshots]:
        if extra is not None and (line := extra.describe()):
            print(line, flush=True)


class Described(Protocol):
    def describe(self) -> str | None: ...


def stop(checkpointer: Checkpointer, error: GoodputError) -> NoReturn:
    """End the run with ``error``, the same on every rank, once a save in flight (of this step
    or an earlier one) has completed."""
    checkpointer.close()
    raise error


def terminated(step: int) -> GoodputError:
    """The stop after SIGTERM (the scheduler's walltime warning), saved or not."""
    return GoodputError(
        "train",
        f"terminated by SIGTERM after step {step}",
        "resubmit: the run resumes from its newest complete checkpoint",
        code=ExitCode.TERMINATED,
    )
