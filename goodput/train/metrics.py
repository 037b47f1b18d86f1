"""Per-step metrics: throughput, MFU, memory — to ``metrics.jsonl``, TensorBoard and one line.

MFU = FLOPs per token (``flops.py``) × tokens/s per device ÷ the device's peak FLOP/s. The peak
is, in order: ``[train] peak_tflops``; the table below (dense bf16 tensor-core datasheet figures,
per device as PyTorch sees it); on a CPU, a matmul probe in the run's compute dtype timed at
start, so CPU MFU is measured against what this machine's matmul reaches, not a datasheet. An
accelerator missing from the table gets no MFU rather than an invented one.

Only rank 0 writes. Every step prints one line starting ``step=N`` (the launcher's progress
signal) and replaces the ``heartbeat`` file (step and time); neither is fsync'd — they say "alive",
they are not records. Once the run is complete, a last beat adds ``done`` (``finished``).
``metrics.jsonl`` is appended and flushed per step, its line the schema's (``runfiles.StepRecord``,
then what else the step measured), strict JSON: a loss or gradient norm that is not finite is
written as null (the step line shows inf or nan). A step the non-finite guard skipped says so in
both (``skipped``, and the run's ``skipped_steps`` so far).
Every record says which data-mix stage the step's samples came from (``stage``, from 0) and the
tokens the run has trained on through it (``tokens``: the loader's global sample count times the
sequence length, so it carries on across a resume, a job chain and a new layout).
A mixture-of-experts model adds the step's expert load imbalance (the most loaded expert's
tokens over the mean, worst layer) and the token-to-expert assignments its capacity dropped.
The in-loop diagnostics add theirs (``monitor/diagnostics.py``: ``gns``, ``loss_z``,
``frozen_fraction``, ``max_attention_logit``, ``sophia_unclipped``), each where it is measured,
and the straggler watch its busy times over ranks (``monitor/stragglers.py``: ``busy_s_*``,
``busy_slowest_rank`` and ``busy_slowest_host``, the one text value, which TensorBoard and
wandb leave out).

Every numeric value of a record but ``step`` and ``time`` (a null, not finite, left out) goes to
TensorBoard as ``train/<key>`` at the record's step, and to Weights & Biases under the same names
when ``[metrics] wandb`` is on (``config/metrics.py``: offline by default; one wandb run per
trainer process, finished by ``close``).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import torch

from goodput import rundir
from goodput.io import json_text, open_append
from goodput.progress import print_line
from goodput.runfiles import StepRecord, json_line, nonfinite_as_null
from goodput.train.config.metrics import MetricsConfig
from goodput.train.device import device_name, peak_memory_bytes
from goodput.train.step import StepResult

# (substring of the device name, dense bf16 TFLOP/s per device); the first match wins.
PEAK_BF16_TFLOPS = (
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # SXM
    ("A100", 312.0),
    ("MI300X", 1307.4),
    ("MI250X", 191.5),  # per GCD: PyTorch sees each of a card's two dies as a device
    ("Max 1550", 419.4),  # Intel PVC, per stack: each stack is a device in FLAT mode
)
PROBE_SIZE = 1024
PROBE_SECONDS = 0.5
PROBE_WINDOWS = 5


def peak_flops(
    device: torch.device, dtype: torch.dtype, configured_tflops: float | None
) -> tuple[float | None, str]:
    """(peak FLOP/s per device or None, where the figure came from)."""
    if configured_tflops is not None:
        return configured_tflops * 1e12, "train.peak_tflops"
    name = device_name(device)
    if device.type == "cpu":
        return measure_matmul_flops(device, dtype), f"matmul probe on {name} ({dtype})"
    peak = datasheet_peak_flops(name)
    if peak is None:
        return None, f"unknown device {name!r}: set train.peak_tflops for MFU"
    return peak, f"datasheet bf16 peak of {name}"


def datasheet_peak_flops(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


@functools.cache
def measure_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of back-to-back square matmuls with the threads this process has: the best of
    several short windows, since a neighbour's burst only ever makes a window slower. Its
    operands come from a generator of its own: it runs after a resume restored the run's
    generators, and a draw from those would shift every later one (dropout, sampling).
    Measured once a process (half a second): a rank that enters training again after an
    in-process recovery keeps its figure, and a warm spare measures it while it waits."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device, generator=generator).to(dtype)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE, device=device, generator=generator).to(dtype)
    torch.mm(a, b)  # warm-up: first call picks kernels
    best = 0.0
    for _ in range(PROBE_WINDOWS):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < PROBE_SECONDS / PROBE_WINDOWS:
            torch.mm(a, b)
            count += 1
        best = max(best, count * 2 * PROBE_SIZE**3 / elapsed)
    return best


class Metrics:
    """Turns each step's result into a record and writes it; silent on ranks other than 0."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        tokens_per_step: int,
        flops_per_token: int,
        peak_flops_per_device: float | None,
        tensorboard: bool,
        sinks: MetricsConfig | None = None,
    ):
        self.run_dir, self.world_size, self.device = run_dir, world_size, device
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak = peak_flops_per_device
        self.enabled = rank == 0
        self.jsonl = open_append(run_dir / rundir.METRICS) if self.enabled else None
        self.tensorboard = tensorboard_writer(run_dir) if self.enabled and tensorboard else None
        sinks = sinks if sinks is not None else MetricsConfig()
        self.wandb = _wandb_run(sinks, run_dir) if self.enabled and sinks.wandb else None
        self.heartbeats = rundir.heartbeat_files(run_dir, os.environ) if self.enabled else []

    def step(
        self,
        step: int,
        result: StepResult,
        lr: float,
        step_time_s: float,
        skipped_steps: int,
        diagnosed: Mapping[str, float | int | str | None] | None = None,
        *,
        stage: int,
        tokens: int,
    ) -> dict[str, Any]:
        """The record of ``step``, written on rank 0; ``skipped_steps``: the run's so far;
        ``diagnosed``: the in-loop diagnostics' values (``Diagnostics.after_step``); ``stage``:
        the data-mix stage of the step's samples; ``tokens``: the run's through this step."""
        tokens_per_s = self.tokens_per_step / step_time_s
        per_device = tokens_per_s / self.world_size
        measured: dict[str, float | int | str | None] = {}
        if result.expert_load is not None:
            measured["expert_load_imbalance"] = result.expert_load.imbalance
            measured["dropped_tokens"] = result.expert_load.dropped_tokens
        record = StepRecord(
            step=step,
            loss=result.loss,
            grad_norm=result.grad_norm,
            lr=lr,
            tokens_per_s=tokens_per_s,
            tokens_per_s_per_device=per_device,
            mfu=self.flops_per_token * per_device / self.peak if self.peak else None,
            peak_memory_gib=peak_memory_bytes(self.device) / 2**30,
            step_time_s=step_time_s,
            skipped=result.skipped,
            skipped_steps=skipped_steps,
            time=time.time(),
            stage=stage,
            tokens=tokens,
            measured={**measured, **(diagnosed or {})},
        ).as_json()
        if self.enabled:
            self._write(record)
        return record

    def _write(self, record: dict[str, Any]) -> None:
        assert self.jsonl is not None
        finite = nonfinite_as_null(record)
        self.jsonl.write(json_line(finite, where=self.jsonl.name))
        self.jsonl.flush()
        scalars = scalars_of(finite)
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])
        print_line(step_line(record))
        self._beat({"step": record["step"], "time": record["time"]})

    def finished(self, step: int) -> None:
        """The run is complete (``done`` written): a last beat says so, so that goodput launch
        never retries a run whose processes linger or fail after it (a hung teardown)."""
        self._beat({"step": step, "time": time.time(), "done": True})

    def _beat(self, beat: dict[str, Any]) -> None:
        text = json_text(beat, where=rundir.HEARTBEAT)
        for heartbeat in self.heartbeats:  # the run's, and goodput launch's when it is another
            tmp = heartbeat.with_name(f".heartbeat.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, heartbeat)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def step_line(record: dict[str, Any]) -> str:
    mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] is not None else "n/a"
    return (
        f"step={record['step']} loss={record['loss']:.4f} grad_norm={record['grad_norm']:.3f} "
        f"lr={record['lr']:.3g} tokens/s={record['tokens_per_s']:,.0f} "
        f"tokens/s/device={record['tokens_per_s_per_device']:,.0f} mfu={mfu} "
        f"mem={record['peak_memory_gib']:.2f}GiB step_time={record['step_time_s']:.3f}s"
        + (
            f" expert_load={record['expert_load_imbalance']:.2f}x"
            f" dropped={record['dropped_tokens']}"
            if "expert_load_imbalance" in record
            else ""
        )
        + (f" gns={record['gns']:,.0f}" if record.get("gns") is not None else "")
        + (
            f" max_logit={record['max_attention_logit']:.1f}"
            if record.get("max_attention_logit") is not None
            else ""
        )
        + (
            f" SKIPPED: gradient norm not finite, no optimizer step "
            f"({record['skipped_steps']} skipped in all)"
            if record.get("skipped")
            else ""
        )
    )


def scalars_of(record: dict[str, Any]) -> dict[str, float | int]:
    """The record's numeric values as ``train/<key>``, for TensorBoard and wandb alike: every
    key but ``step`` (their x axis) and ``time``; None (not finite, or not measured) left out."""
    return {
        f"train/{key}": value
        for key, value in record.items()
        if key not in ("step", "time") and isinstance(value, int | float)
    }


def _wandb_run(sinks: MetricsConfig, run_dir: Path) -> Any:
    """A wandb run of this process (``check_sinks`` found wandb installed): grouped by the run
    directory's name; no console capture, so stdout stays the step lines' alone."""
    import wandb

    root = Path(sinks.wandb_dir) if sinks.wandb_dir is not None else run_dir
    root.mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=sinks.wandb_project,
        mode=sinks.wandb_mode,
        dir=str(root),
        group=run_dir.resolve().name,
        job_type="train",
        # create_new: this run is ours alone, whatever else in the process uses wandb.
        settings=wandb.Settings(console="off", disable_git=True, reinit="create_new"),
    )


def tensorboard_writer(
    run_dir: Path, who: str = "metrics", instead: str = rundir.METRICS, file: TextIO | None = None
) -> Any:
    """A ``SummaryWriter`` on ``RUN/tensorboard``, or None (saying so, as ``who``, to ``file``:
    stdout by default) when tensorboard is not installed and ``instead`` has it all."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print(f"{who}: tensorboard is not installed; writing {instead} only", file=file, flush=True)
        return None
    return SummaryWriter(str(run_dir / rundir.TENSORBOARD))
