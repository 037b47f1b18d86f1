"""Parallel layouts on one GPU node: tokens/s, MFU and peak memory of a ~1B Llama per layout.

``python benchmarks/gpu_layouts.py`` (or ``python -m benchmarks.gpu_layouts``) finds the node's
accelerators, picks every layout below that fits them, and runs each as a short real
``goodput launch --nproc N -- goodput train CONFIG overrides...`` on a synthetic corpus. It
prints a Markdown table, one line per layout with the exact command that produced it, and
writes the same as JSON to ``bench-out/gpu_layouts.json``. With no accelerator it refuses in
one line (exit 2); ``--dry-run --devices N`` prints the layouts and commands for N devices
anywhere, and ``--tiny`` runs the same code path with a tiny shape (on CPU gloo ranks when
there is no accelerator), which is how it is tested off GPUs.

Layouts (a degree that does not divide the device count drops the layout; the data-parallel
degree takes what tp x pp x cp leave): FSDP ``dp_shard=N``; HSDP ``dp_replicate=2``; ``tp=2``,
``tp=4``, ``tp=8`` (tensor parallelism within the node, sequence parallelism, loss-parallel);
``pp=2`` with 1F1B and with interleaved 1F1B (two stages a rank); ``tp=2,pp=2``; context
parallelism (ring attention, the device's fused attention kernel per block) ``cp=2``, ``cp=4``,
``cp=2,tp=2``; and the MoE variant of the shape (each MLP 8 experts of a quarter of its ffn,
top-2) under FSDP and expert parallelism ``ep=2``, ``ep=4``, ``ep=8``. Throughput levers under
FSDP: ``compile=true`` alone, then FP8 (torchao's float8 training) ``fp8=rowwise`` and
``fp8=tensorwise`` (whose FSDP all-gathers float8 weights), each eager and with compile, and
``fp8=rowwise`` with ``tp=2``; then activation checkpointing, against the shared ``"full"``:
``"none"``, ``"op"`` eager and compiled, and ``"budget"`` (0.5, compiled). The compiled fp8
rows against ``compile=true`` alone are fp8's gain
(torchtitan's published fp8 figures are compiled). On a device without FP8 matmuls (before
compute capability 8.9) the fp8 rows fail with the trainer's one-line refusal; on CPU ranks
(``--tiny``) they run torchao's emulation, which says nothing about speed. On one device only
``dp_shard=1`` (dense and MoE) and the lever rows are left.

Shape (``FULL``): a 1.07B-parameter Llama (vocab 32,000, dim 2,048, 20 layers, 16 heads, 8 KV
heads, ffn 5,632: tp up to 8 divides every split), seq_len 2,048, precision ``fp32-master``
(bf16 compute), activation checkpointing on. The global batch is the same for every layout on a
node: 4 samples per device (8,192 tokens), in micro-batches of 2.

Figures, from rank 0's ``metrics.jsonl``: each run is 25 steps (``--steps``); the first 5
(allocator, communicators, kernel choice) are dropped and each figure is the median of the
rest. Tokens/s is the whole job's; MFU is goodput's own (PaLM FLOPs per token, no recompute
counted, against the device's datasheet bf16 peak), so activation checkpointing's extra forward
is not credited; peak memory is rank 0's peak allocated device memory (under pipeline
parallelism rank 0 holds the first stage, and other ranks may peak higher). Each row keeps its
losses too: same seed, same batches, so the layouts' curves should agree to bf16 rounding. One
run per layout, no repeats: a GPU node is quiet, and the budget is ten minutes. ``--tiny``
figures measure nothing (CPU ranks sharing cores, a CPU probe for MFU): it shows the runs work.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from goodput import argtypes, rundir
from goodput.config import to_toml
from goodput.errors import GoodputError
from goodput.io import write_json
from goodput.plan.layout import Layout
from goodput.testing.tiny import write_random_corpus
from goodput.train.config.model import ModelConfig, MoEConfig
from goodput.train.config.parallel import ParallelConfig
from goodput.train.config.run import DataConfig, RunConfig, TrainConfig
from goodput.train.device import backend_for, detect_device_type, device_name
from goodput.train.flops import model_size

USAGE_ERROR = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    model: ModelConfig
    seq_len: int
    samples_per_device: int  # the global batch is this times the device count
    micro_batch_size: int
    steps: int
    warmup_steps: int
    corpus_tokens: int  # the synthetic corpus; the blend repeats it when a run reads more


FULL = Shape(
    model=ModelConfig(
        vocab_size=32000,
        dim=2048,
        num_layers=20,
        num_heads=16,
        num_kv_heads=8,
        ffn_dim=5632,
        max_seq_len=2048,
    ),
    seq_len=2048,
    samples_per_device=4,
    micro_batch_size=2,
    steps=25,
    warmup_steps=5,
    corpus_tokens=8_000_000,
)
# The same code path at a size a CPU runs in seconds: four layers, so that interleaved 1F1B
# still has one layer per stage, and heads, KV heads, ffn and vocabulary that tp = 8 divides.
TINY = Shape(
    model=ModelConfig(
        vocab_size=512,
        dim=128,
        num_layers=4,
        num_heads=16,
        num_kv_heads=8,
        ffn_dim=256,
        max_seq_len=64,
    ),
    seq_len=64,
    samples_per_device=4,
    micro_batch_size=2,
    steps=4,
    warmup_steps=1,
    corpus_tokens=100_000,
)
PARALLEL = ParallelConfig(precision="fp32-master", activation_checkpointing="full")
LAUNCH_IDLE_TIMEOUT_S = 300  # a hung layout stops here rather than eat the node's budget
RUN_TIMEOUT_S = 480
CPU_RANKS = 2  # --tiny with no accelerator and no --devices


# The MoE rows' model: the shape's, each MLP 8 experts of a quarter of its ffn, top-2 (about the
# dense model's active FLOPs per token), as [model.moe] overrides.
MOE_OVERRIDES = {"num_experts": 8, "top_k": 2}
MOE_FFN_FRACTION = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One layout of the table: its degrees but ``dp_shard``, which takes what they leave of the
    devices (``on``); the pipeline's schedule and which model it runs."""

    split: Layout = Layout()  # its dp_shard is left at 1: ``on`` resolves it
    interleaved: bool = False
    moe: bool = False  # the MoE variant of the shape's model
    # Throughput levers, as [parallel] keys over the shared config's: (key, value) pairs.
    levers: tuple[tuple[str, Any], ...] = ()

    def on(self, devices: int) -> Layout | None:
        """The layout on ``devices``, ``dp_shard`` taking what the other degrees leave; None:
        the layout does not fit."""
        model_parallel = self.split.product()
        if devices % model_parallel:
            return None
        layout = replace(self.split, dp_shard=devices // model_parallel)
        if layout.dp_shard % layout.ep:  # expert parallelism borrows ranks of dp_shard
            return None
        # HSDP with nothing to shard is plain replication: not the layout this row is about.
        return None if layout.dp_replicate > 1 and layout.dp_shard < 2 else layout

    def name(self, devices: int) -> str:
        layout = self.on(devices)
        assert layout is not None, "only a layout that fits is named"
        degrees = [f"dp_replicate={layout.dp_replicate}"] if layout.dp_replicate > 1 else []
        degrees.append(f"dp_shard={layout.dp_shard}")
        others = {key: getattr(layout, key) for key in ("tp", "pp", "cp", "ep")}
        degrees += [f"{key}={value}" for key, value in others.items() if value > 1]
        schedule = " interleaved_1f1b" if self.interleaved else (" 1f1b" if layout.pp > 1 else "")
        levers = "".join(f" {key}={_toml(value)}" for key, value in self.levers)
        return ("moe " if self.moe else "") + ",".join(degrees) + schedule + levers

    def parallel(self, devices: int) -> dict[str, Any]:
        """This layout's ``[parallel]`` keys on ``devices``, over the shared config's."""
        layout = self.on(devices)
        assert layout is not None, "only a layout that fits is run"
        values: dict[str, Any] = layout.by_name()
        if self.interleaved:
            values["pp_schedule"] = "interleaved_1f1b"
        return values | dict(self.levers)

    def model(self, shape: Shape) -> ModelConfig:
        if not self.moe:
            return shape.model
        ffn = shape.model.mlp_dim // MOE_FFN_FRACTION
        return replace(shape.model, moe=MoEConfig(**MOE_OVERRIDES, expert_ffn_dim=ffn))

    def model_overrides(self, shape: Shape) -> list[str]:
        moe = self.model(shape).moe
        if moe is None:
            return []
        keys = {**MOE_OVERRIDES, "expert_ffn_dim": moe.expert_ffn_dim}
        return [f"model.moe.{key}={value}" for key, value in keys.items()]


ROWS = (
    Row(),
    Row(split=Layout(dp_replicate=2)),
    Row(split=Layout(tp=2)),
    Row(split=Layout(tp=4)),
    Row(split=Layout(tp=8)),
    Row(split=Layout(pp=2)),
    Row(split=Layout(pp=2), interleaved=True),
    Row(split=Layout(tp=2, pp=2)),
    Row(split=Layout(cp=2)),
    Row(split=Layout(cp=4)),
    Row(split=Layout(cp=2, tp=2)),
    Row(moe=True),
    Row(split=Layout(ep=2), moe=True),
    Row(split=Layout(ep=4), moe=True),
    Row(split=Layout(ep=8), moe=True),
    # FP8 (torchao's float8 training): each recipe eager and compiled, against compile alone
    # (torchtitan's fp8 figures are compiled: fp8's casts are separate kernels eagerly);
    # tensorwise is the recipe whose FSDP all-gathers float8 weights.
    Row(levers=(("compile", True),)),
    Row(levers=(("fp8", "rowwise"),)),
    Row(levers=(("fp8", "tensorwise"),)),
    Row(levers=(("fp8", "rowwise"), ("compile", True))),
    Row(levers=(("fp8", "tensorwise"), ("compile", True))),
    Row(split=Layout(tp=2), levers=(("fp8", "rowwise"),)),
    # What each block keeps for backward, against the shared config's "full": nothing
    # recomputed (where it fits), per op (torchtitan's 8B recipe), per op compiled, and the
    # compile partitioner's budget.
    Row(levers=(("activation_checkpointing", "none"),)),
    Row(levers=(("activation_checkpointing", "op"),)),
    Row(levers=(("activation_checkpointing", "op"), ("compile", True))),
    Row(levers=(("activation_checkpointing", "budget"), ("compile", True))),
)


def accelerator() -> tuple[str, int]:
    """(device type, how many) as goodput's trainer would find them; 0 devices on a machine
    whose device type has no accelerator backend (CPU, and MPS: one device, gloo)."""
    device_type = detect_device_type()
    if backend_for(device_type) == "gloo":
        return device_type, 0
    return device_type, int(getattr(torch, device_type).device_count())


def write_corpus(directory: Path, shape: Shape) -> Path:
    return write_random_corpus(
        directory,
        vocab_size=shape.model.vocab_size,
        num_docs=shape.corpus_tokens // (2 * shape.seq_len),
        lengths=(64, 4 * shape.seq_len),
    )


def write_config(directory: Path, shape: Shape, devices: int, file_list: Path) -> Path:
    """The run config every layout shares; each layout overrides ``[parallel]`` and
    ``train.run_dir``."""
    cfg = RunConfig(
        model=shape.model,
        train=TrainConfig(
            steps=shape.steps,
            tokens_per_step=shape.samples_per_device * devices * shape.seq_len,
            seq_len=shape.seq_len,
            micro_batch_size=shape.micro_batch_size,
            run_dir=str(directory / "run"),
            tensorboard=False,
        ),
        data=DataConfig(file_list=str(file_list), cache=str(directory / "blend-cache")),
        parallel=PARALLEL,
    )
    path = directory / "config.toml"
    path.write_text(to_toml(cfg))
    return path


def command(
    row: Row, devices: int, config: Path, run_dir: Path, shape: Shape, *, emulate_fp8: bool
) -> list[str]:
    """``emulate_fp8``: fp8 rows run torchao's emulation (CPU ranks, which have no FP8 matmuls:
    the path runs, its speed means nothing)."""
    goodput = [sys.executable, "-m", "goodput"]
    launch = ["launch", "--nproc", str(devices), "--timeout", str(LAUNCH_IDLE_TIMEOUT_S)]
    launch += ["--log", str(run_dir / "launch.log")]
    parallel = row.parallel(devices)
    if emulate_fp8 and "fp8" in parallel:
        parallel["fp8_emulate"] = True
    overrides = row.model_overrides(shape)
    overrides += [f"parallel.{key}={_toml(value)}" for key, value in parallel.items()]
    train = ["train", str(config), *overrides, f"train.run_dir={run_dir}"]
    return [*goodput, *launch, "--", *goodput, *train]


def run_layout(argv: list[str], run_dir: Path, shape: Shape) -> dict[str, Any]:
    """One layout's run and its figures, or its failure in one line."""
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"status": f"no result within {RUN_TIMEOUT_S} s"}
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        lines = (done.stdout + done.stderr).strip().splitlines() or ["(no output)"]
        # The trainer's one-line error (rank, host, cause) over the launcher's summary after it.
        errors = [line for line in lines if "error:" in line]
        return {"status": f"exit {done.returncode}: {(errors or lines)[-1]}", "seconds": seconds}
    records = [json.loads(line) for line in (run_dir / rundir.METRICS).read_text().splitlines()]
    steady = records[shape.warmup_steps :]
    mfu = [r["mfu"] for r in steady if r["mfu"] is not None]
    return {
        "status": "ok",
        "seconds": seconds,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "tokens_per_s_per_device": statistics.median(r["tokens_per_s_per_device"] for r in steady),
        "mfu": statistics.median(mfu) if mfu else None,
        "peak_memory_gib": max(r["peak_memory_gib"] for r in records),
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "losses": [r["loss"] for r in records],
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | tokens/s | tokens/s/device | MFU | peak memory, rank 0 | step | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cmd = f"`{row['command']}`"
        if row["status"] != "ok":
            lines.append(f"| {row['layout']} | {row['status']} | | | | | {cmd} |")
            continue
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
        lines.append(
            f"| {row['layout']} | {row['tokens_per_s']:,.0f} | "
            f"{row['tokens_per_s_per_device']:,.0f} | {mfu} | {row['peak_memory_gib']:.1f} GiB | "
            f"{row['step_time_s']:.3f} s | {cmd} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_layouts", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "--devices",
        type=argtypes.positive_int,
        help=f"devices to use (default: all found; with none found, {CPU_RANKS} CPU ranks)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the layouts and commands, run nothing"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny shape, on CPU gloo ranks if no accelerator"
    )
    parser.add_argument(
        "--layout",
        action="append",
        dest="layouts",
        metavar="NAME",
        help="run this layout, as --dry-run names it (repeatable; default: every one that fits)",
    )
    parser.add_argument(
        "--steps", type=argtypes.positive_int, help="steps per run (default: the shape's)"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=Path("bench-out/gpu_layouts"), help="corpus and runs"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out/gpu_layouts.json"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device_type, found = accelerator()
    if found == 0 and not (args.dry_run or args.tiny):
        return refuse(
            f"no accelerator found (device type {device_type}); run it on a GPU node, or see "
            "the plan with --dry-run --devices N, or run --tiny on CPU"
        )
    devices = args.devices or found or CPU_RANKS
    if found and devices > found and not args.dry_run:
        return refuse(f"--devices {devices}, but {found} found")
    shape = TINY if args.tiny else FULL
    if args.steps is not None:
        shape = replace(shape, steps=args.steps)
    if shape.steps <= shape.warmup_steps:
        return refuse(f"--steps {shape.steps}: the first {shape.warmup_steps} are warm-up")
    rows = chosen_rows(devices, args.layouts, shape)
    if rows is None:
        return USAGE_ERROR
    # A fresh folder per invocation: a run directory left by an earlier one would be resumed,
    # and its metrics.jsonl appended to.
    work = args.work_dir.resolve() / time.strftime("%Y%m%d-%H%M%S")
    run_dirs = {
        row.name(devices): work / f"{index}-{slug(row.name(devices))}"
        for index, row in enumerate(rows)
    }
    commands = {
        name: command(
            row,
            devices,
            work / "config.toml",
            run_dirs[name],
            shape,
            # A dry run shows what a GPU node runs; a real run without one is --tiny on CPU.
            emulate_fp8=found == 0 and not args.dry_run,
        )
        for name, row in zip(run_dirs, rows, strict=True)
    }
    if args.dry_run:
        print(f"gpu_layouts: {len(commands)} layout(s) on {devices} device(s):")
        for name, argv_ in commands.items():
            print(f"  {name}: {shlex.join(argv_)}")
        return 0
    work.mkdir(parents=True)
    write_config(work, shape, devices, write_corpus(work, shape))
    results = []
    for name, argv_ in commands.items():
        print(f"gpu_layouts: {name} ...", flush=True)
        result = {"layout": name, "command": shlex.join(argv_)}
        results.append(result | run_layout(argv_, run_dirs[name], shape))
    device = torch.device(device_type, 0) if found else torch.device("cpu")
    report(args.out, device_name(device), devices, shape, results)
    return 0 if all(result["status"] == "ok" for result in results) else 1


def report(out: Path, device: str, devices: int, shape: Shape, rows: list[dict[str, Any]]) -> None:
    """The JSON file and the printed table."""
    parameters = model_size(shape.model).total
    tokens_per_step = shape.samples_per_device * devices * shape.seq_len
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(
        out,
        {
            "device": device,
            "devices": devices,
            "model_parameters": parameters,
            "seq_len": shape.seq_len,
            "tokens_per_step": tokens_per_step,
            "steps": shape.steps,
            "warmup_steps": shape.warmup_steps,
            "rows": rows,
        },
    )
    print(
        f"{device} x {devices}, {parameters / 1e6:,.1f}M parameters, {tokens_per_step:,} tokens "
        f"a step; median of steps {shape.warmup_steps + 1}-{shape.steps}; JSON in {out}"
    )
    print(markdown(rows))


def refuse(reason: str) -> int:
    print(f"gpu_layouts: {reason}", file=sys.stderr)
    return USAGE_ERROR


def chosen_rows(devices: int, names: list[str] | None, shape: Shape) -> list[Row] | None:
    """The rows whose layouts fit, or those of them named; None (after saying why) for a name
    that is not one of them, or a layout that cannot split the shape's model."""
    fitting = {row.name(devices): row for row in ROWS if row.on(devices) is not None}
    unknown = [name for name in names or () if name not in fitting]
    if unknown:
        refuse(f"unknown layout(s) {unknown}; on {devices} device(s): {'; '.join(fitting)}")
        return None
    chosen = [fitting[name] for name in names] if names else list(fitting.values())
    # Checked here as the trainer will check it, so that a shape a layout cannot split fails
    # before any run (and in a dry run), not after minutes of others.
    for row in chosen:
        try:
            parallel = replace(PARALLEL, **row.parallel(devices))
            parallel.check_model(row.model(shape), shape.seq_len)
        except GoodputError as error:
            refuse(f"{row.name(devices)}: {error}")
            return None
    return chosen


def _toml(value: Any) -> str:
    """A lever's value as an override spells it (``true``, not Python's ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


if __name__ == "__main__":
    sys.exit(main())
