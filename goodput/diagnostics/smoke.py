"""``goodput diagnose smoke``: the bit-exact smoke gate, run after every dependency upgrade.

Runs a config for a few steps and records each step's loss, gradient norm and peak memory
(``record``), or compares them with a baseline recorded before (``check``), stopping at the first
step and metric that differ with both values and the environment differences it can see. The
record file is ``smoke_record``'s.

How it runs: one child process of ``goodput train`` (the real trainer: ``train.loop.train``) as
a single rank on gloo, in a throw-away run directory, with the numbers read back from the run's
``metrics.jsonl``. A child rather than a call in this process: its peak memory is the run's own
(on CPU that is the process's peak RSS), and nothing the caller did (seeds, thread settings, a
process group) leaks into the numbers. One rank rather than the config's ranks under ``goodput
launch``: the gate watches the numerics of the stack, which one rank exercises (forward,
backward, clip, optimizer, the FSDP wrapping), while a launcher adds a rendezvous and minutes,
not kernels. The child runs one intra-op thread, so results do not depend on the machine's core
count and the gate does not crawl when CI shares its cores. Overrides: the step count, the run
directory and checkpoint folder (both throw-away), no checkpoint saved or resumed, no
TensorBoard.

What is compared:

- loss and grad_norm: bit for bit when the baseline was recorded on CPU and runs on the same
  CPU model (``bit_exact``); on any other device, or another CPU model, within a relative
  ``KERNEL_TOLERANCE`` (GPU libraries pick kernels, and reduction orders, by version and shape;
  MKL picks its kernels by the CPU).
- peak_memory_gib: within a relative ``PEAK_MEMORY_TOLERANCE`` on every device: on CPU it is
  the process's peak RSS, which moves with the allocator and the libraries' sizes.
- the run config, before anything runs: a baseline recorded with another config (machine-local
  paths aside), another step count or on another device type is a usage error (exit 2) naming
  what differs. The data is compared by content: its blend fingerprint is in the environment.
"""

from __future__ import annotations

import json
import math
import os
import platform
import struct
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from goodput import __version__, rundir
from goodput.checkpoint.load import config_diff
from goodput.config import from_table, load_config, to_toml
from goodput.data.manifest import git_sha
from goodput.diagnostics.smoke_record import (
    ENVIRONMENT_LABELS,
    MAX_STEPS,
    METRICS,
    SmokeRecord,
    StepValues,
    read_record,
    write_record,
)
from goodput.errors import ExitCode, GoodputError
from goodput.io import read_json, read_json_lines
from goodput.launch.env import LOCAL_RANK_FALLBACKS, LOCAL_SIZE_FALLBACKS, RANK_SOURCES
from goodput.train.config import RunConfig
from goodput.train.device import detect_device_type, device_name

KERNEL_TOLERANCE = (
    1e-3  # relative, loss and grad_norm on other kernels: a wrong reduction is far above
)
# Relative. CPU RSS moved by up to 7% between two runs in one venv and by 17-22% between a fresh
# venv (a CI clone) and the one the demo baseline was recorded in: a gross leak or a doubled
# activation footprint is what this can catch, not a few percent.
PEAK_MEMORY_TOLERANCE = 0.5
NOT_COMPARED = "(a path on the recording machine: not compared)"
# Whatever would make the child a rank of some job rather than a single process.
PLACEMENT_VARIABLES = frozenset(name for source in RANK_SOURCES for name in source[1:]) | frozenset(
    LOCAL_RANK_FALLBACKS + LOCAL_SIZE_FALLBACKS
)


@dataclass(frozen=True, slots=True)
class Difference:
    step: int
    metric: str
    baseline: float
    now: float
    tolerance: float  # relative; 0: bit for bit


def record(config: Path, overrides: Sequence[str], num_steps: int, path: Path) -> str:
    """Run ``config`` for ``num_steps`` and write the record to ``path``; the line to print."""
    if num_steps > MAX_STEPS:
        raise GoodputError.usage(
            "--steps", f"{num_steps} is above {MAX_STEPS:,}", "a smoke run is short: pass fewer"
        )
    result = run_smoke(config, overrides, num_steps)
    for values in result.steps:
        for metric in METRICS:
            if not math.isfinite(value := getattr(values, metric)):
                raise GoodputError(
                    config,
                    f"step {values.step} {metric} is {value}: a baseline holds finite numbers only",
                    "fix the run (a lower learning rate, other data) before recording it",
                )
    write_record(path, result)
    return f"smoke: recorded {num_steps} steps of {config} in {path}"


def check(
    config: Path, overrides: Sequence[str], num_steps: int | None, baseline_path: Path
) -> tuple[ExitCode, str]:
    """Run ``config`` as ``baseline_path`` was recorded and compare; the exit code and the line
    to print: OK, or the first difference."""
    baseline = read_record(baseline_path)
    recorded_steps = len(baseline.steps)
    if num_steps not in (None, recorded_steps):
        raise GoodputError.usage(
            "--steps",
            f"{num_steps} differs from the {recorded_steps} steps of {baseline_path}",
            "leave --steps out (the baseline's count is used), or record a new baseline",
        )
    config_text = comparable_config(config, overrides, recorded_steps)
    _require_same_config(baseline_path, baseline.config, config_text)
    _require_same_device(baseline_path, baseline.environment["device"])
    now = run_smoke(config, overrides, recorded_steps)
    changes = environment_changes(baseline.environment, now.environment)
    environment = f"environment: {'; '.join(changes) or 'no differences seen'}"
    difference = first_difference(baseline, now)
    if difference is None:
        exact = (
            "bit for bit" if bit_exact(baseline, now) else f"within {_percent(KERNEL_TOLERANCE)}"
        )
        return ExitCode.OK, (
            f"smoke: OK: {recorded_steps} steps match {baseline_path} (loss and grad_norm "
            f"{exact}, peak memory within {_percent(PEAK_MEMORY_TOLERANCE)}; {environment})"
        )
    by = f" by more than {_percent(difference.tolerance)}" if difference.tolerance else ""
    return ExitCode.ERROR, (
        f"smoke: step {difference.step} {difference.metric} differs{by}: baseline "
        f"{difference.baseline!r} vs now {difference.now!r} ({environment})"
    )


def first_difference(baseline: SmokeRecord, now: SmokeRecord) -> Difference | None:
    """The first step, and within it the first metric, where ``now`` leaves ``baseline``."""
    exact = bit_exact(baseline, now)
    for old, new in zip(baseline.steps, now.steps, strict=True):
        for metric in METRICS:
            if metric == "peak_memory_gib":
                tolerance = PEAK_MEMORY_TOLERANCE
            else:
                tolerance = 0.0 if exact else KERNEL_TOLERANCE
            a, b = getattr(old, metric), getattr(new, metric)
            if not agrees(a, b, tolerance):
                return Difference(old.step, metric, a, b, tolerance)
    return None


def bit_exact(baseline: SmokeRecord, now: SmokeRecord) -> bool:
    """Whether the same kernels ran, so that any difference at all is a finding: on CPU, and on
    the CPU model the baseline was recorded on. MKL picks its matmul kernels by the CPU it finds
    (vendor and vector units), below ATen's pinned capability, so another CPU model moves the last
    bits: the demo baseline of an AMD EPYC ran on an Intel Xeon (both with ATen on AVX2) at up to
    1.6e-7 relative in the loss and 1.9e-5 in grad_norm over its 50 steps."""
    same_cpu = baseline.environment["device_name"] == now.environment["device_name"]
    return baseline.environment["device"] == "cpu" and same_cpu


def agrees(baseline: float, now: float, tolerance: float) -> bool:
    """Within ``tolerance`` relative to ``baseline``; with 0, the same float64 bits (so -0.0 is
    not 0.0, and NaN agrees with nothing here: a baseline never holds one)."""
    if tolerance == 0:
        return struct.pack("<d", baseline) == struct.pack("<d", now)
    return abs(now - baseline) <= tolerance * abs(baseline)


def environment_changes(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    return [
        f"{label} {old[key]} -> {new[key]}"
        for key, label in ENVIRONMENT_LABELS.items()
        if old[key] != new[key]
    ]


def comparable_config(config: Path, overrides: Sequence[str], num_steps: int) -> str:
    """The config as the smoke runs it, as TOML, with the paths that only mean something on the
    recording machine replaced: two runs of the same recipe on two machines compare equal."""
    cfg = load_config(RunConfig, config, [*overrides, *_smoke_overrides(num_steps, "scratch")])
    local = NOT_COMPARED
    train = replace(cfg.train, run_dir=local)
    data = replace(cfg.data, file_list=local, cache=local)
    checkpoint = replace(cfg.checkpoint, folder=local, local_dir=None)
    return to_toml(replace(cfg, train=train, data=data, checkpoint=checkpoint))


def run_smoke(config: Path, overrides: Sequence[str], num_steps: int) -> SmokeRecord:
    """``goodput train`` of ``config`` for ``num_steps`` as one child process; its record."""
    config_text = comparable_config(config, overrides, num_steps)  # a bad config fails here
    with tempfile.TemporaryDirectory(prefix="goodput-smoke-") as scratch:
        run_dir = Path(scratch) / "run"
        argv = [sys.executable, "-m", "goodput", "train", str(config.absolute()), *overrides]
        argv += _smoke_overrides(num_steps, scratch)
        code = subprocess.call(argv, env=_child_environment())
        if code != 0:
            raise GoodputError(
                config,
                f"the smoke run failed (goodput train exited with {code})",
                "fix what its output above names, then rerun",
            )
        steps = _read_steps(run_dir / rundir.METRICS, num_steps)
        fingerprint = read_json(run_dir / rundir.RUN_RECORD)["data"]["fingerprint"]
    return SmokeRecord(config_text, current_environment(fingerprint), steps)


def current_environment(data_fingerprint: str) -> dict[str, str]:
    """What this process can see of the stack the child ran on (the same interpreter, the same
    environment variables but the thread count and the placement)."""
    import torch

    device_type = detect_device_type()
    return {
        "torch": torch.__version__,
        "device": device_type,
        "device_name": device_name(torch.device(device_type)),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "goodput": __version__,
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "data_fingerprint": data_fingerprint,
    }


def _smoke_overrides(num_steps: int, scratch: str) -> list[str]:
    """The smoke's own settings: its step count, everything written under ``scratch``, no
    checkpoint saved (by steps, time or SIGTERM) or resumed, no TensorBoard."""
    return [
        f"train.steps={num_steps}",
        f"train.run_dir={json.dumps(str(Path(scratch) / 'run'))}",
        "train.tensorboard=false",
        f"checkpoint.folder={json.dumps(str(Path(scratch) / 'checkpoints'))}",
        "checkpoint.interval_steps=0",
        "checkpoint.interval_minutes=0.0",
        'checkpoint.resume="never"',
        "checkpoint.save_on_sigterm=false",
    ]


def _child_environment() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in PLACEMENT_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"  # torch's intra-op threads, and MKL's with them
    return env


def _read_steps(metrics_file: Path, num_steps: int) -> tuple[StepValues, ...]:
    """Steps 1..``num_steps`` from the run's metrics; a non-finite value was written as null."""
    steps = []
    fix = "rerun; if it persists, report it"
    for _where, entry in read_json_lines(metrics_file, rundir.MAX_LINE_BYTES, fix=fix):
        values = {m: math.nan if entry[m] is None else float(entry[m]) for m in METRICS}
        steps.append(StepValues(step=entry["step"], **values))
    if [values.step for values in steps] != list(range(1, num_steps + 1)):
        raise GoodputError(
            metrics_file,
            f"the smoke run wrote {len(steps)} step records, not steps 1 to {num_steps}",
            "rerun; if it persists, report it",
        )
    return tuple(steps)


def _require_same_config(path: Path, recorded: str, now: str) -> None:
    # Read through today's RunConfig: a key goodput gained since the recording takes its
    # default on both sides, and only a value that was set differently counts.
    recorded = to_toml(from_table(RunConfig, tomllib.loads(recorded), str(path)))
    differences = config_diff(tomllib.loads(recorded), tomllib.loads(now))
    if differences:
        more = f" and {len(differences) - 3} more" if len(differences) > 3 else ""
        raise GoodputError.usage(
            path,
            f"was recorded with another config: {'; '.join(differences[:3])}{more}",
            "run the config (and overrides) the baseline was recorded with, or record a new "
            "baseline with --record",
        )


def _require_same_device(path: Path, recorded: str) -> None:
    now = detect_device_type()
    if now != recorded:
        raise GoodputError.usage(
            path,
            f"was recorded on {recorded}, this run would be on {now}",
            f"compare where {recorded} is the device (GOODPUT_DEVICE picks it), or record a "
            f"baseline on {now}",
        )


def _percent(fraction: float) -> str:
    return f"{100 * fraction:g}%"
