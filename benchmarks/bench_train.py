"""Trainer overhead: ``goodput train`` against a bare PyTorch loop, same model, batch, optimizer.

Baseline: the ~30-line loop in ``_bare_loop`` — the same ``Transformer`` (20.5M parameters:
vocab 8,192, dim 384, 8 layers, 6 heads, seq_len 256) initialised from the same seed, the same
AdamW (foreach, betas (0.9, 0.95), weight decay on matrices only via ``parameter_groups``), the
same LR schedule, global-norm clipping at 1.0, mean cross-entropy, and the same 4-sample batches
read from the same blend — but pre-loaded into memory, so the baseline pays nothing for data,
and with no process group, no metrics, no logging. Ours is the whole ``goodput train`` run
(``train(RunConfig)``, what the CLI calls): blend loader, LR, ``train_step``, metrics.jsonl,
TensorBoard, heartbeat, step line (stdout/stderr go to a log file, as under a launcher).

Precision: fp32 on both sides, so both do the same arithmetic and their losses agree (checked
below); a bare loop has no equivalent of FSDP's bf16 mixed-precision policy (autocast casts per
op, a different amount of work). fp32 is also what ``configs/tiny-cpu.toml`` uses, and with it
goodput skips FSDP on a single rank (FSDP's hooks cost ~12% of a step here and shard nothing).
A second goodput side runs the default precision, ``fp32-master`` (FSDP's bf16 compute policy;
this CPU has AMX): its tokens/s is reported for information — it is a different amount of work,
not an overhead figure — with its MFU against a bf16 matmul probe.

Target: ours >= 0.95 of the bare loop's tokens/s, single process on CPU.

Figures: each run is ``STEPS`` steps; the first ``WARMUP_STEPS`` are dropped and the run's figure
is the median of the rest. Ours: ``step_time_s`` from ``metrics.jsonl`` (the whole iteration:
data, step, logging of the previous step). The bare loop times each iteration the same way,
fetching its batch included. ``REPEATS`` repeats, each running every side back to back (order
reversed on odd repeats), so this shared machine's drift hits all sides alike. Ratio: the median
over repeats of (bare step time / ours step time) within each repeat; tokens/s: tokens per step
over the median of the runs' step times. MFU = FLOPs per token (PaLM convention,
``goodput.train.flops``) x tokens/s / peak, with the peak the median of ``PEAK_PROBES`` matmul
probes per repeat in the side's compute dtype (``measure_matmul_flops``, the probe the trainer
itself uses on CPU); the MFU goodput itself logged (its probe at the start of each run) is
reported next to it.

Gradient accumulation (the FSDP gradient sync): the whole ``goodput train`` on
``ACCUM_RANKS`` gloo ranks (one core each, as a launcher would bind them), FSDP fp32,
``ACCUM_MICRO_BATCHES`` micro-batches of one sample per rank and step, the same model. Ours:
FSDP reduces the gradients once a step, after the last micro-batch (``[parallel]
sync_every_micro_batch = false``, the default); baseline: a reduce-scatter after every
micro-batch (``true``, what goodput did before). ``ACCUM_REPEATS`` repeats, both sides back to
back (order reversed on odd repeats); figures as above (median over repeats of each run's
steady-step median, from rank 0's ``metrics.jsonl``), and the ratio is the median of baseline /
ours step time within each repeat. Rank 0's peak resident memory is reported beside: the
deferred sync holds unsharded gradients across the accumulation. Both sides must log the same
losses.

Beacon overhead (``goodput.beacon``): a small model (``BEACON_MODEL``, a few ms a step, so that
the beacon's share of a step is as large as it gets) on ``ACCUM_RANKS`` gloo ranks, FSDP fp32,
``ACCUM_MICRO_BATCHES`` micro-batches a step: every FSDP all-gather and reduce-scatter, every
phase and step update goes through the beacon. Baseline: the same run without
``GOODPUT_BEACON_DIR`` (the counters then live in process memory: the updates are the same, only
the page differs); ours: with it (the mmap'd file, the stack dump's signal handler).
``BEACON_REPEATS`` repeats, both sides back to back (order reversed on odd repeats); the ratio is
the median of (with / without step time) within each repeat; the losses must be equal. Beside
it, the ns per update (``Beacon.step``) and per bracket (``with collective``, two updates) of a
file-backed beacon, the median of ``MICRO_REPEATS`` timed loops of ``MICRO_UPDATES``.

Activation checkpointing (``[parallel] activation_checkpointing``): the same model, fp32,
``CHECKPOINTING_BATCH`` samples in one micro-batch (so that activations outweigh the weights and
the optimizer state), one rank in a fresh process per run (a process's peak resident memory
never falls: each mode needs its own). Sides: ``"none"`` (the baseline), ``"full"``, ``"op"``,
and compiled: ``"none"`` and ``"budget"`` at 0.5 (the partitioner's budget exists only under
compile). ``CHECKPOINTING_REPEATS`` repeats, sides in alternating order; each side's step time
and peak RSS (the trainer's ``peak_memory_gib``, on CPU the process's) is the median over
repeats. The eager modes must log the same losses as ``"none"``, bit for bit.

Zero-bubble pipeline schedules (``[parallel] pp_schedule``): ``PIPELINE_MODEL`` (8 layers, a
small vocabulary so that the last stage's head does not dominate) on ``PIPELINE_RANKS`` gloo
ranks as one pipeline (pp 4, one core a rank), fp32, ``PIPELINE_MICRO_BATCHES`` micro-batches
of one sample a step (the fewest ``dualpipev`` takes on 4 ranks, where the bubble is large).
Baseline: ``1f1b`` (4 stages of 2 layers); sides: ``interleaved_zb``, ``zbv`` and ``dualpipev``
(8 stages of 1 layer). ``PIPELINE_REPEATS`` repeats, each one spawn running every schedule in
turn (the order rotated per repeat); a run's figure is the median of its steady steps; the
ratio is the median over repeats of (1f1b / side step time) within each repeat. All sides must
log the same losses (to fp32 rounding: the sums run in another order). The bubble is a rank's
idle time, so it shows only where each rank has a core of its own: with fewer cores than ranks
the busy ranks take the idle ones' cores, and what remains is the zero-bubble schedules' own
cost (twice the stages, a backward run in two parts).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.bench_layouts import train_each
from goodput import beacon, rundir
from goodput.data.blend import BlendSpec, BlendStage, build_blend
from goodput.data.loader import DataLoader
from goodput.ranks import BEACON_DIR_VAR
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import write_random_corpus
from goodput.train.config.model import ModelConfig
from goodput.train.config.optim import OptimConfig
from goodput.train.config.parallel import ParallelConfig
from goodput.train.config.run import DataConfig, RunConfig, TrainConfig
from goodput.train.config.schedule import ScheduleConfig, learning_rate
from goodput.train.flops import flops_per_token, model_size
from goodput.train.loop import train
from goodput.train.metrics import measure_matmul_flops
from goodput.train.model import Transformer
from goodput.train.optim.optimizers import parameter_groups

MODEL = ModelConfig(vocab_size=8192, dim=384, num_layers=8, num_heads=6, max_seq_len=256)
SEQ_LEN = 256
BATCH = 4  # samples per step, one micro-batch: ~0.9 s a step on 2 vCPUs
STEPS = 7
WARMUP_STEPS = 2
REPEATS = 9  # runs of one side differ by up to ~30% on this shared VM
PEAK_PROBES = 2
SEED = 0
OPTIM = OptimConfig()
SCHEDULE = ScheduleConfig(lr=1e-3, warmup_steps=2)
MAX_GRAD_NORM = 1.0
OURS = {
    "fp32": ParallelConfig(precision="fp32"),  # the headline: same arithmetic as the bare loop
    "fp32_master": ParallelConfig(),  # the default policy, bf16 compute: for information
}
PROBE_DTYPES = {"fp32": torch.float32, "fp32_master": torch.bfloat16}
ACCUM_RANKS = 2
ACCUM_MICRO_BATCHES = 4  # per rank and step, one sample each
ACCUM_REPEATS = 5
SYNC_EVERY_MICRO_BATCH = {"last": False, "every": True}  # ours, then the baseline
# What each block keeps for backward (``[parallel] activation_checkpointing``), each side a fresh
# one-rank process so that its peak resident memory is its own; the compiled sides pay their
# compile in the warm-up steps.
CHECKPOINTING: dict[str, ParallelConfig] = {
    "none": ParallelConfig(precision="fp32"),
    "full": ParallelConfig(precision="fp32", activation_checkpointing="full"),
    "op": ParallelConfig(precision="fp32", activation_checkpointing="op"),
    "compiled none": ParallelConfig(precision="fp32", compile=True),
    "compiled budget 0.5": ParallelConfig(
        precision="fp32", compile=True, activation_checkpointing="budget"
    ),
}
CHECKPOINTING_BATCH = 8  # samples a step, one micro-batch: activations well above the weights
CHECKPOINTING_REPEATS = 3
CHECKPOINTING_STEPS = 5  # WARMUP_STEPS dropped (the compiled sides' compile among them)
PIPELINE_MODEL = ModelConfig(
    vocab_size=512, dim=256, num_layers=8, num_heads=4, max_seq_len=SEQ_LEN
)
PIPELINE_RANKS = 4
PIPELINE_MICRO_BATCHES = 8
PIPELINE_REPEATS = 3
PIPELINE_SCHEDULES = ("1f1b", "interleaved_zb", "zbv", "dualpipev")  # the baseline first
BEACON_MODEL = ModelConfig(vocab_size=MODEL.vocab_size, dim=64, num_layers=2, num_heads=2)
BEACON_STEPS = 30
BEACON_REPEATS = 5
MICRO_UPDATES = 100_000
MICRO_REPEATS = 5


def _bare_loop(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[float], list[float]]:
    """The baseline: (seconds per iteration, losses)."""
    torch.manual_seed(SEED)  # as the trainer seeds before building its model: the same init
    model = Transformer(MODEL)
    optimizer = torch.optim.AdamW(
        parameter_groups(model, OPTIM.weight_decay),
        lr=SCHEDULE.lr,
        betas=OPTIM.betas,
        eps=OPTIM.eps,
        foreach=True,
    )
    seconds, losses = [], []
    data = iter(batches)
    last = time.perf_counter()
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(SCHEDULE, step, STEPS)
        input_ids, labels = next(data)
        logits = model(input_ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        now = time.perf_counter()
        seconds.append(now - last)
        last = now
    return seconds, losses


def _write_corpus(directory: Path) -> Path:
    return write_random_corpus(
        directory, vocab_size=MODEL.vocab_size, num_docs=200, lengths=(20, 1000), seed=SEED
    )


def _run_config(
    tmp: Path,
    file_list: Path,
    parallel: ParallelConfig,
    output: Path,
    *,
    batch: int = BATCH,
    micro_batch_size: int = BATCH,
    model: ModelConfig = MODEL,
    steps: int = STEPS,
) -> RunConfig:
    return RunConfig(
        model=model,
        train=TrainConfig(
            steps=steps,
            tokens_per_step=batch * SEQ_LEN,
            seq_len=SEQ_LEN,
            micro_batch_size=micro_batch_size,
            run_dir=str(output),
            max_grad_norm=MAX_GRAD_NORM,
            seed=SEED,
        ),
        data=DataConfig(file_list=str(file_list), cache=str(tmp / "cache")),
        optim=OPTIM,
        schedule=SCHEDULE,
        parallel=parallel,
    )


def _ours(cfg: RunConfig) -> list[dict[str, Any]]:
    """One ``goodput train`` run; its metrics.jsonl records."""
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True)
    with (
        open(run_dir / "train.log", "w") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        train(cfg)
    lines = (run_dir / rundir.METRICS).read_text().splitlines()
    return [json.loads(line) for line in lines]


def _train_rank(rank: int, world_size: int, cfg: RunConfig) -> None:
    """One rank of a multi-rank ``goodput train``, on one core, its output to a log file."""
    torch.set_num_threads(1)
    log_path = Path(cfg.train.run_dir) / f"train-rank{rank}.log"
    with (
        open(log_path, "w") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        train(cfg)


def _steady(values: list[float]) -> float:
    return statistics.median(values[WARMUP_STEPS:])


def _accumulation(tmp: Path, file_list: Path) -> dict[str, Any]:
    """FSDP gradient sync once a step against after every micro-batch (module docstring)."""
    step_s: dict[str, list[float]] = {side: [] for side in SYNC_EVERY_MICRO_BATCH}
    memory_gib: dict[str, list[float]] = {side: [] for side in SYNC_EVERY_MICRO_BATCH}
    losses: dict[str, list[float]] = {}
    runs = itertools.count()
    sides = list(SYNC_EVERY_MICRO_BATCH)
    for repeat in range(ACCUM_REPEATS):
        for side in sides if repeat % 2 == 0 else reversed(sides):
            parallel = ParallelConfig(
                precision="fp32", sync_every_micro_batch=SYNC_EVERY_MICRO_BATCH[side]
            )
            output = tmp / f"accumulation{next(runs)}"
            output.mkdir()
            cfg = _run_config(
                tmp,
                file_list,
                parallel,
                output,
                batch=ACCUM_RANKS * ACCUM_MICRO_BATCHES,
                micro_batch_size=1,
            )
            run_distributed(_train_rank, ACCUM_RANKS, cfg, timeout_s=600)
            lines = (output / rundir.METRICS).read_text().splitlines()
            records = [json.loads(line) for line in lines]
            step_s[side].append(_steady([r["step_time_s"] for r in records]))
            memory_gib[side].append(records[-1]["peak_memory_gib"])
            losses.setdefault(side, [r["loss"] for r in records])
    ratios = [every / last for every, last in zip(step_s["every"], step_s["last"], strict=True)]
    tokens_per_step = ACCUM_RANKS * ACCUM_MICRO_BATCHES * SEQ_LEN
    return {
        "step_seconds_each": step_s,
        **{f"sync_{side}_step_s": statistics.median(step_s[side]) for side in sides},
        **{
            f"sync_{side}_tokens_per_s": tokens_per_step / statistics.median(step_s[side])
            for side in sides
        },
        **{f"sync_{side}_peak_memory_gib": statistics.median(memory_gib[side]) for side in sides},
        "ratio": statistics.median(ratios),
        "ratio_each": ratios,
        "max_loss_difference": max(
            abs(a - b) for a, b in zip(losses["last"], losses["every"], strict=True)
        ),
    }


def _checkpointing(tmp: Path, file_list: Path) -> dict[str, Any]:
    """Step time and peak memory for each of ``CHECKPOINTING``'s modes (module docstring)."""
    step_s: dict[str, list[float]] = {side: [] for side in CHECKPOINTING}
    memory_gib: dict[str, list[float]] = {side: [] for side in CHECKPOINTING}
    losses: dict[str, list[float]] = {}
    runs = itertools.count()
    sides = list(CHECKPOINTING)
    for repeat in range(CHECKPOINTING_REPEATS):
        for side in sides if repeat % 2 == 0 else reversed(sides):
            output = tmp / f"checkpointing{next(runs)}"
            output.mkdir()
            cfg = _run_config(
                tmp,
                file_list,
                CHECKPOINTING[side],
                output,
                batch=CHECKPOINTING_BATCH,
                micro_batch_size=CHECKPOINTING_BATCH,
                steps=CHECKPOINTING_STEPS,
            )
            run_distributed(_train_rank, 1, cfg, timeout_s=900)
            lines = (output / rundir.METRICS).read_text().splitlines()
            records = [json.loads(line) for line in lines]
            step_s[side].append(_steady([r["step_time_s"] for r in records]))
            memory_gib[side].append(records[-1]["peak_memory_gib"])
            losses.setdefault(side, [r["loss"] for r in records])
    eager = ("none", "full", "op")
    return {
        "step_seconds_each": step_s,
        "peak_memory_gib_each": memory_gib,
        **{f"{side}_step_s": statistics.median(step_s[side]) for side in sides},
        **{f"{side}_peak_memory_gib": statistics.median(memory_gib[side]) for side in sides},
        "eager_losses_equal": all(losses[side] == losses["none"] for side in eager),
        "compiled_max_loss_difference": max(
            abs(a - b)
            for a, b in zip(losses["compiled none"], losses["compiled budget 0.5"], strict=True)
        ),
    }


def _pipeline_schedules(tmp: Path) -> dict[str, Any]:
    """Step time of each zero-bubble schedule against 1F1B (module docstring)."""
    corpus = tmp / "pipeline-corpus"
    corpus.mkdir()
    file_list = write_random_corpus(
        corpus, vocab_size=PIPELINE_MODEL.vocab_size, num_docs=200, lengths=(20, 1000), seed=SEED
    )
    step_s: dict[str, list[float]] = {side: [] for side in PIPELINE_SCHEDULES}
    losses: dict[str, list[float]] = {}
    runs = itertools.count()
    for repeat in range(PIPELINE_REPEATS):
        shift = repeat % len(PIPELINE_SCHEDULES)
        order = [*PIPELINE_SCHEDULES[shift:], *PIPELINE_SCHEDULES[:shift]]
        configs = {
            side: _run_config(
                tmp,
                file_list,
                ParallelConfig(precision="fp32", pp=PIPELINE_RANKS, pp_schedule=side),
                tmp / f"pipeline{next(runs)}",
                batch=PIPELINE_MICRO_BATCHES,
                micro_batch_size=1,
                model=PIPELINE_MODEL,
            )
            for side in order
        }
        run_distributed(train_each, PIPELINE_RANKS, list(configs.values()), timeout_s=900)
        for side, cfg in configs.items():
            lines = (Path(cfg.train.run_dir) / rundir.METRICS).read_text().splitlines()
            records = [json.loads(line) for line in lines]
            step_s[side].append(_steady([r["step_time_s"] for r in records]))
            losses.setdefault(side, [r["loss"] for r in records])
    baseline = PIPELINE_SCHEDULES[0]
    ratios = {
        side: [b / s for b, s in zip(step_s[baseline], step_s[side], strict=True)]
        for side in PIPELINE_SCHEDULES[1:]
    }
    return {
        "step_seconds_each": step_s,
        **{f"{side}_step_s": statistics.median(step_s[side]) for side in PIPELINE_SCHEDULES},
        **{f"ratio_{side}": statistics.median(ratios[side]) for side in ratios},
        **{f"ratio_{side}_each": ratios[side] for side in ratios},
        "max_relative_loss_difference": max(
            abs(a - b) / abs(b)
            for side in ratios
            for a, b in zip(losses[side], losses[baseline], strict=True)
        ),
    }


def _print_pipeline_schedules(figures: dict[str, Any]) -> None:
    parameters = model_size(PIPELINE_MODEL).total / 1e6
    print(
        f"pipeline schedules: pp {PIPELINE_RANKS} (one core a rank), {parameters:.1f}M "
        f"parameters, {PIPELINE_MICRO_BATCHES} micro-batches of 1 x {SEQ_LEN} tokens a step, "
        f"fp32; {PIPELINE_REPEATS} repeats"
    )
    baseline = PIPELINE_SCHEDULES[0]
    print(f"  {baseline + ' (baseline)':<16}: step {figures[f'{baseline}_step_s']:.3f} s")
    for side in PIPELINE_SCHEDULES[1:]:
        each = figures[f"ratio_{side}_each"]
        print(
            f"  {side:<16}: step {figures[f'{side}_step_s']:.3f} s  "
            f"{figures[f'ratio_{side}']:.2f}x as fast as 1f1b (repeats {min(each):.2f}-"
            f"{max(each):.2f})"
        )
    print(f"  losses equal 1f1b's to {figures['max_relative_loss_difference']:.1e} (relative)")


def _print_checkpointing(figures: dict[str, Any]) -> None:
    print(
        f"activation checkpointing: {CHECKPOINTING_BATCH} x {SEQ_LEN} tokens a step, fp32, one "
        f"process (fresh for each run); {CHECKPOINTING_REPEATS} repeats"
    )
    for side in CHECKPOINTING:
        print(
            f"  {side:<22}: step {figures[f'{side}_step_s']:.3f} s "
            f"({figures[f'{side}_step_s'] / figures['none_step_s']:.2f}x none)  peak RSS "
            f"{figures[f'{side}_peak_memory_gib']:.2f} GiB"
        )
    print(
        f"  eager modes' losses equal: {figures['eager_losses_equal']}; compiled budget vs "
        f"compiled none: {figures['compiled_max_loss_difference']:.1e}"
    )


def _beacon_overhead(tmp: Path, file_list: Path) -> dict[str, Any]:
    """The same multi-rank run with and without beacon files (module docstring)."""
    sides = ["without", "with"]
    step_s: dict[str, list[float]] = {side: [] for side in sides}
    losses: dict[str, list[float]] = {}
    runs = itertools.count()
    for repeat in range(BEACON_REPEATS):
        for side in sides if repeat % 2 == 0 else reversed(sides):
            output = tmp / f"beacon{next(runs)}"
            output.mkdir()
            cfg = _run_config(
                tmp,
                file_list,
                ParallelConfig(precision="fp32"),
                output,
                batch=ACCUM_RANKS * ACCUM_MICRO_BATCHES,
                micro_batch_size=1,
                model=BEACON_MODEL,
                steps=BEACON_STEPS,
            )
            with _beacon_dir(output / "beacons" if side == "with" else None):
                run_distributed(_train_rank, ACCUM_RANKS, cfg, timeout_s=600)
            lines = (output / rundir.METRICS).read_text().splitlines()
            records = [json.loads(line) for line in lines]
            step_s[side].append(_steady([r["step_time_s"] for r in records]))
            losses.setdefault(side, [r["loss"] for r in records])
    ratios = [w / wo for w, wo in zip(step_s["with"], step_s["without"], strict=True)]
    return {
        "step_seconds_each": step_s,
        **{f"{side}_step_s": statistics.median(step_s[side]) for side in sides},
        "ratio": statistics.median(ratios),
        "ratio_each": ratios,
        "losses_equal": losses["with"] == losses["without"],
        **_beacon_update_ns(tmp / "micro"),
    }


@contextlib.contextmanager
def _beacon_dir(directory: Path | None) -> Iterator[None]:
    """``GOODPUT_BEACON_DIR`` set to ``directory`` (None: unset) for the ranks spawned inside."""
    before = os.environ.pop(BEACON_DIR_VAR, None)
    if directory is not None:
        os.environ[BEACON_DIR_VAR] = str(directory)
    try:
        yield
    finally:
        os.environ.pop(BEACON_DIR_VAR, None)
        if before is not None:
            os.environ[BEACON_DIR_VAR] = before


def _beacon_update_ns(directory: Path) -> dict[str, float]:
    """ns per ``Beacon.step`` and per ``with collective`` on a file-backed beacon."""
    opened = beacon.open_beacon(
        {BEACON_DIR_VAR: str(directory)}, rank=0, world_size=1, local_rank=0, host="bench"
    )
    assert opened is not None
    bracket = opened.collective("step.sums")
    update_ns, bracket_ns = [], []
    try:
        for _ in range(MICRO_REPEATS):
            start = time.perf_counter_ns()
            for n in range(MICRO_UPDATES):
                opened.step(n)
            update_ns.append((time.perf_counter_ns() - start) / MICRO_UPDATES)
            start = time.perf_counter_ns()
            for _ in range(MICRO_UPDATES):
                with bracket:
                    pass
            bracket_ns.append((time.perf_counter_ns() - start) / MICRO_UPDATES)
    finally:
        opened.close()
    return {
        "update_ns": statistics.median(update_ns),
        "bracket_ns": statistics.median(bracket_ns),
    }


def main() -> dict[str, Any]:
    fpt = flops_per_token(MODEL, SEQ_LEN)
    tokens_per_step = BATCH * SEQ_LEN
    sides = ["bare", *OURS]
    step_s: dict[str, list[float]] = {side: [] for side in sides}
    logged_mfu: dict[str, list[float]] = {side: [] for side in OURS}
    losses: dict[str, list[float]] = {}
    peaks: dict[str, list[float]] = {side: [] for side in OURS}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="goodput-bench-") as tmp_name:
        tmp = Path(tmp_name)
        file_list = _write_corpus(tmp)
        data = _run_config(tmp, file_list, OURS["fp32"], tmp).data
        # The blend the trainer will find in its cache; the baseline's batches come from it.
        blend_dir, _ = build_blend(
            BlendSpec(
                stages=(BlendStage(file_list, 0),),
                seq_len=SEQ_LEN,
                num_samples=STEPS * BATCH,
                seed=data.seed,
                cache=Path(data.cache),
                on_exhausted=data.on_exhausted,
            )
        )
        loader = DataLoader(blend_dir, global_batch_size=BATCH, dp_rank=0, dp_size=1)
        batches = list(itertools.islice(loader, STEPS))
        runs = itertools.count()
        for repeat in range(REPEATS):
            for side, dtype in PROBE_DTYPES.items():
                peaks[side] += [
                    measure_matmul_flops(torch.device("cpu"), dtype) for _ in range(PEAK_PROBES)
                ]
            for side in sides if repeat % 2 == 0 else reversed(sides):
                gc.collect()
                if side == "bare":
                    seconds, side_losses = _bare_loop(batches)
                else:
                    output = tmp / f"run{next(runs)}"
                    records = _ours(_run_config(tmp, file_list, OURS[side], output))
                    seconds = [r["step_time_s"] for r in records]
                    side_losses = [r["loss"] for r in records]
                    logged_mfu[side].append(_steady([r["mfu"] for r in records]))
                step_s[side].append(_steady(seconds))
                losses.setdefault(side, side_losses)
        accumulation = _accumulation(tmp, file_list)
        beacon_overhead = _beacon_overhead(tmp, file_list)
        checkpointing = _checkpointing(tmp, file_list)
        pipeline_schedules = _pipeline_schedules(tmp)
    peak = {side: statistics.median(peaks[side]) for side in OURS}
    peak["bare"] = peak["fp32"]
    ratios = {
        side: [b / o for b, o in zip(step_s["bare"], step_s[side], strict=True)] for side in OURS
    }
    tokens_per_s = {side: tokens_per_step / statistics.median(step_s[side]) for side in sides}
    figures: dict[str, Any] = {
        "model_parameters": model_size(MODEL).total,
        "flops_per_token": fpt,
        "tokens_per_step": tokens_per_step,
        "peak_tflops_fp32": peak["fp32"] / 1e12,
        "peak_tflops_bf16": peak["fp32_master"] / 1e12,
        "step_seconds_each": step_s,
        **{f"{side}_tokens_per_s": tokens_per_s[side] for side in sides},
        **{f"ratio_{side}": statistics.median(ratios[side]) for side in OURS},
        **{f"ratio_{side}_each": ratios[side] for side in OURS},
        **{f"{side}_mfu": fpt * tokens_per_s[side] / peak[side] for side in sides},
        **{f"{side}_mfu_logged": statistics.median(logged_mfu[side]) for side in OURS},
        "max_loss_difference_fp32": max(
            abs(a - b) for a, b in zip(losses["bare"], losses["fp32"], strict=True)
        ),
        "accumulation": accumulation,
        "beacon_overhead": beacon_overhead,
        "checkpointing": checkpointing,
        "pipeline_schedules": pipeline_schedules,
        "seconds": time.perf_counter() - start,
    }
    _print_summary(figures)
    return figures


def _print_summary(figures: dict[str, Any]) -> None:
    print(
        f"train overhead: {figures['model_parameters'] / 1e6:.1f}M-parameter model, "
        f"{BATCH} x {SEQ_LEN} tokens a step, 1 process on CPU; {REPEATS} repeats, "
        f"each the median of steps {WARMUP_STEPS + 1}-{STEPS}"
    )
    print(
        f"  peaks (best-window matmul probes, median): fp32 "
        f"{figures['peak_tflops_fp32'] * 1e3:.1f} GFLOP/s, bf16 "
        f"{figures['peak_tflops_bf16'] * 1e3:.1f} GFLOP/s; "
        f"{figures['flops_per_token'] / 1e6:.1f} MFLOP/token"
    )
    rows = (
        ("bare PyTorch loop, fp32 (baseline)", "bare", "target >= 0.95"),
        ("goodput train, fp32", "fp32", "target >= 0.95"),
        ("goodput train, fp32-master", "fp32_master", "bf16 compute: not an overhead figure"),
    )
    for label, side, note in rows:
        ratio = ""
        if side in OURS:
            each = figures[f"ratio_{side}_each"]
            ratio = (
                f"  {figures[f'ratio_{side}']:.3f}x bare (repeats {min(each):.2f}-"
                f"{max(each):.2f}; {note})"
            )
        print(
            f"  {label:<36}: {figures[f'{side}_tokens_per_s']:7.1f} tokens/s  "
            f"MFU {100 * figures[f'{side}_mfu']:4.1f}%{ratio}"
        )
    print(
        f"  goodput's own logged MFU: fp32 {100 * figures['fp32_mfu_logged']:.1f}%, fp32-master "
        f"{100 * figures['fp32_master_mfu_logged']:.1f}% (against its start-up probe)"
    )
    print(f"  fp32 losses equal the bare loop's to {figures['max_loss_difference_fp32']:.1e}")
    accumulation = figures["accumulation"]
    each = accumulation["ratio_each"]
    print(
        f"gradient accumulation: {ACCUM_RANKS} ranks x {ACCUM_MICRO_BATCHES} micro-batches of 1 x "
        f"{SEQ_LEN} tokens, FSDP fp32, one core a rank; {ACCUM_REPEATS} repeats"
    )
    for side, label in (("every", "sync every micro-batch (baseline)"), ("last", "sync once")):
        print(
            f"  {label:<36}: {accumulation[f'sync_{side}_tokens_per_s']:7.1f} tokens/s  "
            f"step {accumulation[f'sync_{side}_step_s']:.3f} s  rank-0 peak RSS "
            f"{accumulation[f'sync_{side}_peak_memory_gib']:.2f} GiB"
        )
    print(
        f"  sync once is {accumulation['ratio']:.3f}x faster (repeats {min(each):.2f}-"
        f"{max(each):.2f}); losses equal to {accumulation['max_loss_difference']:.1e}"
    )
    _print_beacon(figures["beacon_overhead"])
    _print_checkpointing(figures["checkpointing"])
    _print_pipeline_schedules(figures["pipeline_schedules"])
    print(f"{figures['seconds']:.0f} s in all")


def _print_beacon(overhead: dict[str, Any]) -> None:
    each = overhead["ratio_each"]
    parameters = model_size(BEACON_MODEL).total / 1e6
    print(
        f"beacon overhead: {ACCUM_RANKS} ranks, FSDP fp32, {parameters:.1f}M parameters, "
        f"{ACCUM_MICRO_BATCHES} micro-batches a step, {BEACON_STEPS} steps; "
        f"{BEACON_REPEATS} repeats"
    )
    for side in ("without", "with"):
        print(
            f"  {side + ' GOODPUT_BEACON_DIR':<36}: step {overhead[f'{side}_step_s'] * 1e3:.2f} ms"
        )
    print(
        f"  with/without {overhead['ratio']:.3f} (repeats {min(each):.2f}-{max(each):.2f}); "
        f"losses equal: {overhead['losses_equal']}; {overhead['update_ns']:.0f} ns an update, "
        f"{overhead['bracket_ns']:.0f} ns a bracket (file-backed)"
    )
