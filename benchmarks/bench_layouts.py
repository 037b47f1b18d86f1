"""Parallel layouts on CPU: the whole ``goodput train`` on 4 gloo ranks, each layout against
``dp_shard=4`` (plain FSDP) on the same model and the same global batch.

Dense layouts: ``dp_shard=4`` (the baseline), HSDP ``dp_replicate=2,dp_shard=2``, tensor
parallelism ``dp_shard=2,tp=2`` (sequence parallelism, loss-parallel), pipeline parallelism
``pp=2,dp_shard=2`` with the 1F1B and the interleaved 1F1B schedules (two stages a rank),
``tp=2,pp=2``, and context parallelism (ring attention) ``cp=2,dp_shard=2`` and ``cp=2,tp=2``.
Model: a 6.8M-parameter Llama shape (vocab 4,096, dim 256, 6 layers, 8 heads, 4 KV heads, ffn
768; the four interleaved stages hold 2, 2, 1 and 1 layers, so each rank holds three, with the
embedding on one and the output head on the other), fp32, seq_len 128; each step is 16 samples
in micro-batches of 2, however the layout splits them (pure DP: 2 micro-batches a rank; pp=2: 4
a pipeline; tp=2,pp=2: 8; under cp a rank holds 64 tokens of each of its samples).

Mixture-of-experts layouts, against the same MoE model under ``dp_shard=4``: expert parallelism
``ep=2`` (FSDP shards each pair of experts over the other 2 ranks) and ``ep=4`` (each rank holds
2 of the 8 experts). Model: the dense shape with each MLP an MoE of 8 SwiGLU experts of ffn 256,
top-2, with a shared expert (``MOE_MODEL``).

Target: none to meet. Four ranks share this machine's two cores (one thread each), so a layout's
collectives and its pipeline bubble cost far more than on GPUs, where they overlap with compute
over fast links: these figures only say that no layout is gratuitously slow. GPU figures come
from ``benchmarks/gpu_layouts.py``.

Method: ``REPEATS`` repeats; each is one set of 4 spawned ranks that runs every layout's
``train(RunConfig)`` in turn, the order rotated by one layout per repeat so that this shared
machine's drift and any warm-up of the process hit each layout alike. Each run is ``STEPS``
steps; the first ``WARMUP_STEPS`` are dropped and the run's figure is the median of the rest of
``step_time_s`` in rank 0's ``metrics.jsonl`` (the whole iteration: data, step, logging).
Tokens/s: tokens per step over the median of a layout's run figures; ratio: the median over
repeats of (baseline step time / layout step time) within each repeat, so > 1 is faster than
its model's ``dp_shard=4``. All layouts of a model must log the same losses (to
``LOSS_TOLERANCE``), or the benchmark fails: a layout that trains differently is not measured.
No MFU (``train.peak_tflops`` is set, so no run spends time on its CPU matmul probe) and no
memory figure: the ranks live on across layouts, so a process's peak resident memory is the
largest layout's so far.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from goodput import rundir
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import write_random_corpus
from goodput.train.config.model import ModelConfig, MoEConfig
from goodput.train.config.parallel import ParallelConfig
from goodput.train.config.run import DataConfig, RunConfig, TrainConfig
from goodput.train.flops import model_size
from goodput.train.loop import train

MODEL = ModelConfig(
    vocab_size=4096, dim=256, num_layers=6, num_heads=8, num_kv_heads=4, max_seq_len=128
)
SEQ_LEN = 128
BATCH = 16  # samples per step, all ranks together
MICRO_BATCH = 2
STEPS = 4
WARMUP_STEPS = 1
REPEATS = 3
RANKS = 4
SEED = 0
MOE_MODEL = replace(
    MODEL, moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=256, shared_expert=True)
)
BASELINE = "dp_shard=4"
MOE_BASELINE = "moe dp_shard=4"
# name: (model, layout, the name of the baseline it is measured against)
LAYOUTS: dict[str, tuple[ModelConfig, ParallelConfig, str]] = {
    BASELINE: (MODEL, ParallelConfig(precision="fp32", dp_shard=4), BASELINE),
    "dp_replicate=2,dp_shard=2": (
        MODEL,
        ParallelConfig(precision="fp32", dp_replicate=2, dp_shard=2),
        BASELINE,
    ),
    "dp_shard=2,tp=2": (MODEL, ParallelConfig(precision="fp32", dp_shard=2, tp=2), BASELINE),
    "pp=2,dp_shard=2 1f1b": (MODEL, ParallelConfig(precision="fp32", pp=2, dp_shard=2), BASELINE),
    "pp=2,dp_shard=2 interleaved_1f1b": (
        MODEL,
        ParallelConfig(precision="fp32", pp=2, dp_shard=2, pp_schedule="interleaved_1f1b"),
        BASELINE,
    ),
    "tp=2,pp=2": (MODEL, ParallelConfig(precision="fp32", dp_shard=1, tp=2, pp=2), BASELINE),
    "cp=2,dp_shard=2": (MODEL, ParallelConfig(precision="fp32", cp=2, dp_shard=2), BASELINE),
    "cp=2,tp=2": (MODEL, ParallelConfig(precision="fp32", cp=2, dp_shard=1, tp=2), BASELINE),
    MOE_BASELINE: (MOE_MODEL, ParallelConfig(precision="fp32", dp_shard=4), MOE_BASELINE),
    "moe ep=2,dp_shard=4": (MOE_MODEL, ParallelConfig(precision="fp32", ep=2), MOE_BASELINE),
    "moe ep=4,dp_shard=4": (MOE_MODEL, ParallelConfig(precision="fp32", ep=4), MOE_BASELINE),
}
LOSS_TOLERANCE = 1e-4  # fp32, reductions in a different order per layout


def _write_corpus(directory: Path) -> Path:
    return write_random_corpus(
        directory, vocab_size=MODEL.vocab_size, num_docs=200, lengths=(20, 400), seed=SEED
    )


def _run_config(
    tmp: Path, file_list: Path, model: ModelConfig, parallel: ParallelConfig, run_dir: Path
) -> RunConfig:
    return RunConfig(
        model=model,
        train=TrainConfig(
            steps=STEPS,
            tokens_per_step=BATCH * SEQ_LEN,
            seq_len=SEQ_LEN,
            micro_batch_size=MICRO_BATCH,
            run_dir=str(run_dir),
            seed=SEED,
            peak_tflops=1.0,  # no MFU here: skips the CPU matmul probe each run would make
        ),
        data=DataConfig(file_list=str(file_list), cache=str(tmp / "cache")),
        parallel=parallel,
    )


def train_each(rank: int, world_size: int, configs: list[RunConfig]) -> None:
    """One rank of one repeat: every layout's ``goodput train`` in turn, on one core, output to
    a log file beside each run."""
    torch.set_num_threads(1)
    for cfg in configs:
        gc.collect()
        dist.barrier()  # no run starts while a rank still tears down the previous one
        run_dir = Path(cfg.train.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / f"train-rank{rank}.log", "w") as log:
            # At the descriptors, not sys.stdout: torch's warnings (its logging handlers hold
            # the stderr of import time) and gloo's C++ lines go there too. This process is
            # the rank's own, spawned for this repeat.
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(log.fileno(), sys.stdout.fileno())
            os.dup2(log.fileno(), sys.stderr.fileno())
            train(cfg)
            sys.stdout.flush()
            sys.stderr.flush()


def _rotated(names: list[str], repeat: int) -> list[str]:
    shift = repeat % len(names)
    return names[shift:] + names[:shift]


def main() -> dict[str, Any]:
    names = list(LAYOUTS)
    step_s: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="goodput-bench-") as tmp_name:
        tmp = Path(tmp_name)
        file_list = _write_corpus(tmp)
        for repeat in range(REPEATS):
            order = _rotated(names, repeat)
            run_dirs = {
                name: tmp / f"repeat{repeat}" / f"layout{names.index(name)}" for name in order
            }
            configs = [
                _run_config(tmp, file_list, *LAYOUTS[name][:2], run_dirs[name]) for name in order
            ]
            run_distributed(train_each, RANKS, configs, timeout_s=600)
            for name in order:
                lines = (run_dirs[name] / rundir.METRICS).read_text().splitlines()
                records = [json.loads(line) for line in lines]
                step_s[name].append(
                    statistics.median(r["step_time_s"] for r in records[WARMUP_STEPS:])
                )
                losses.setdefault(name, [r["loss"] for r in records])
    tokens_per_step = BATCH * SEQ_LEN
    baselines = {name: LAYOUTS[name][2] for name in names}
    ratios = {
        name: [b / s for b, s in zip(step_s[baselines[name]], step_s[name], strict=True)]
        for name in names
    }
    figures: dict[str, Any] = {
        "model_parameters": model_size(MODEL).total,
        "moe_model_parameters": model_size(MOE_MODEL).total,
        "tokens_per_step": tokens_per_step,
        "step_seconds_each": step_s,
        "tokens_per_s": {name: tokens_per_step / statistics.median(step_s[name]) for name in names},
        "ratio": {name: statistics.median(ratios[name]) for name in names},
        "ratio_each": ratios,
        "max_loss_difference": max(
            abs(a - b)
            for name in names
            for a, b in zip(losses[baselines[name]], losses[name], strict=True)
        ),
        "seconds": time.perf_counter() - start,
    }
    if figures["max_loss_difference"] > LOSS_TOLERANCE:
        raise RuntimeError(f"layouts logged different losses: {losses}")
    _print_summary(figures)
    return figures


def _print_summary(figures: dict[str, Any]) -> None:
    print(
        f"layouts: {figures['model_parameters'] / 1e6:.1f}M-parameter model (MoE: "
        f"{figures['moe_model_parameters'] / 1e6:.1f}M), fp32, {BATCH} x "
        f"{SEQ_LEN} tokens a step, {RANKS} gloo ranks on {len(os.sched_getaffinity(0))} "
        f"cores; {REPEATS} repeats, each the median of steps {WARMUP_STEPS + 1}-{STEPS}"
    )
    for name, (_, _, baseline) in LAYOUTS.items():
        each = figures["ratio_each"][name]
        label = f"{name} (baseline)" if name == baseline else name
        print(
            f"  {label:<34}: {figures['tokens_per_s'][name]:7.1f} tokens/s  "
            f"{figures['ratio'][name]:.3f}x {baseline} (repeats {min(each):.2f}-{max(each):.2f})"
        )
    print(
        f"  losses equal across layouts to {figures['max_loss_difference']:.1e}; "
        f"{figures['seconds']:.0f} s in all"
    )
