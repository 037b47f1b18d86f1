"""``goodput diagnose smoke``: the bit-exact smoke gate, run after every dependency upgrade.

Runs a config for a few steps in a layout (``--nproc`` ranks, the config's ``[parallel]``
table) and records each step's loss, gradient norm and peak memory (``record``), or compares them
with a baseline recorded before (``check``), stopping at the first step and metric that differ
with both values and the environment differences it can see. The record file, which holds the
layout, is ``smoke_record``'s.

How it runs: ``goodput launch --nproc N`` of ``goodput train`` (the real launcher and trainer),
as local ranks on gloo, in a throw-away run directory, with the numbers read back from the run's
``metrics.jsonl`` (rank 0's). Child processes rather than a call in this process: the peak memory
is the run's own (on CPU, rank 0's peak RSS), and nothing the caller did (seeds, thread settings,
a process group) leaks into the numbers. Every layout, one process included, goes through the
launcher, so that the gate runs what a user runs: the seed's own regression (tensor parallelism
logging the loss 1/12 too low) shows only in a layout. Any job around the caller is removed from
the children's environment (its rank variables and its allocation): the ranks are always this
machine's. Each rank runs one intra-op thread, so results do not depend on the machine's core
count and the gate does not crawl when CI shares its cores. Overrides: the step count, the run
directory and checkpoint folder (both throw-away), no checkpoint saved or resumed, no
TensorBoard; a config of data-mix stages keeps those that start before the smoke's last step
(``stage_overrides``, said in a line), since a stage after the run's end is refused.

What is compared, in the baseline's layout:

- loss and grad_norm: bit for bit when the baseline was recorded on CPU and runs on the same
  CPU model (``bit_exact``); on any other device, or another CPU model, within a relative
  ``KERNEL_TOLERANCE`` (GPU libraries pick kernels, and reduction orders, by version and shape;
  MKL picks its kernels by the CPU).
- peak_memory_gib: within a relative ``PEAK_MEMORY_TOLERANCE`` on every device: on CPU it is
  rank 0's peak RSS, which moves with the allocator and the libraries' sizes.

In another layout against a one-process baseline: the layouts' contract (every layout logs the
one process's loss and grad_norm, to float tolerance), so loss and grad_norm within the relative
``LAYOUT_TOLERANCE`` (with ``KERNEL_TOLERANCE`` where that is larger), peak memory not compared (a
rank holds a share of the model). Against a baseline of more ranks in another layout the
comparison would measure two layouts' drift, not the contract: refused, naming both.

Before anything runs: a baseline recorded with another config (machine-local paths and the
layout aside), another step count or on another device type, or a layout the config cannot run
on ``--nproc`` ranks, is a usage error (exit 2) naming what differs. The data is compared by
content: its blend fingerprint is in the environment.
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

from goodput import __version__, rundir, runfiles
from goodput.checkpoint.load import config_diff
from goodput.config import from_table, load_config, to_toml
from goodput.data.manifest import git_sha
from goodput.diagnose.smoke_record import (
    ENVIRONMENT_LABELS,
    MAX_STEPS,
    METRICS,
    SmokeRecord,
    StepValues,
    read_record,
    write_record,
)
from goodput.errors import ExitCode, GoodputError
from goodput.io import read_json
from goodput.launch.env import LOCAL_RANK_FALLBACKS, LOCAL_SIZE_FALLBACKS, RANK_SOURCES
from goodput.train.config.parallel import FSDP_KEYS, MESH_DIMS, PIPELINE_KEYS, ParallelConfig
from goodput.train.config.run import RunConfig, check_world
from goodput.train.device import detect_device_type, device_name

KERNEL_TOLERANCE = (
    1e-3  # relative, loss and grad_norm on other kernels: a wrong reduction is far above
)
# Relative, another layout against a one-process baseline. Measured on the demo config over 50
# steps: tp = 2 and FSDP over 2 ranks drift from one process by at most 4.2e-6 in the loss and
# 9.2e-4 in grad_norm (sums in another order, and trajectories that part a little each step;
# 2.2e-7 over 3 steps in test_layout_invariance). The bugs a layout brings are off by a factor
# (the seed's tensor-parallel loss 1/12 low, a gradient summed twice): far above both.
LAYOUT_TOLERANCE = {"loss": 1e-4, "grad_norm": 1e-2}
# Relative, rank 0's peak RSS on CPU (interpreter and libraries included). Measured on the demo
# config's 50 steps (docs/diagnose.md): 7.4% at most at a step between any two of the committed
# baseline, four runs in its venv (one under goodput launch) and two in a fresh copy of the
# venv. The 17-22% a CI clone read earlier was read through ru_maxrss, which carries a spawning
# parent's peak across exec (device.process_peak_bytes reads VmHWM since); the bound covers that
# too. A leak or a doubled footprint is what this catches, not a few percent.
PEAK_MEMORY_TOLERANCE = 0.25
NOT_COMPARED = "(a path on the recording machine: not compared)"
# The [parallel] keys that place the work on ranks; the rest (precision, compile, activation
# checkpointing) change what is computed or how, and count as config.
LAYOUT_KEYS = ("data_parallel", *MESH_DIMS, "ep", "loss_parallel", *PIPELINE_KEYS, *FSDP_KEYS)
# Whatever would make the launcher a rank of some job, or make it start its ranks through the
# job's srun or mpiexec, rather than on this machine.
PLACEMENT_VARIABLES = frozenset(name for source in RANK_SOURCES for name in source[1:]) | frozenset(
    LOCAL_RANK_FALLBACKS + LOCAL_SIZE_FALLBACKS
)
ALLOCATION_PREFIXES = ("SLURM_", "PBS_")


@dataclass(frozen=True, slots=True)
class Difference:
    step: int
    metric: str
    baseline: float
    now: float
    tolerance: float  # relative; 0: bit for bit


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Where a smoke ran: its ranks and the values of ``LAYOUT_KEYS``."""

    world_size: int
    parallel: tuple[tuple[str, object], ...]

    @classmethod
    def of(cls, config_text: str, world_size: int, where: object) -> Layout:
        """The layout of a smoke's TOML config (read through today's ``RunConfig``: a key
        goodput gained since a recording takes its default) on ``world_size`` ranks."""
        parallel = from_table(RunConfig, tomllib.loads(config_text), str(where)).parallel
        return cls(
            world_size=world_size, parallel=tuple((k, getattr(parallel, k)) for k in LAYOUT_KEYS)
        )

    def __str__(self) -> str:
        """``1 process``, ``2 ranks (tp=2)``: the ranks and the keys set off their defaults."""
        defaults = ParallelConfig()
        chosen = [
            f"{key}={value!r}" for key, value in self.parallel if value != getattr(defaults, key)
        ]
        ranks = "1 process" if self.world_size == 1 else f"{self.world_size} ranks"
        return f"{ranks} ({', '.join(chosen)})" if chosen else ranks


def record(config: Path, overrides: Sequence[str], num_steps: int, nproc: int, path: Path) -> str:
    """Run ``config`` for ``num_steps`` on ``nproc`` ranks and write the record to ``path``; the
    line to print."""
    if num_steps > MAX_STEPS:
        raise GoodputError.usage(
            "--steps", f"{num_steps} is above {MAX_STEPS:,}", "a smoke run is short: pass fewer"
        )
    result = run_smoke(config, overrides, num_steps, nproc)
    for values in result.steps:
        for metric in METRICS:
            if not math.isfinite(value := getattr(values, metric)):
                raise GoodputError(
                    config,
                    f"step {values.step} {metric} is {value}: a baseline holds finite numbers only",
                    "fix the run (a lower learning rate, other data) before recording it",
                )
    write_record(path, result)
    return f"smoke: recorded {num_steps} steps of {config} on {_layout(result)} in {path}"


def check(
    config: Path,
    overrides: Sequence[str],
    num_steps: int | None,
    nproc: int | None,
    baseline_path: Path,
) -> tuple[ExitCode, str]:
    """Run ``config`` as ``baseline_path`` was recorded, on ``nproc`` ranks (None: the
    baseline's), and compare; the exit code and the line to print: OK, or the first
    difference."""
    baseline = read_record(baseline_path)
    recorded_steps = len(baseline.steps)
    if num_steps not in (None, recorded_steps):
        raise GoodputError.usage(
            "--steps",
            f"{num_steps} differs from the {recorded_steps} steps of {baseline_path}",
            "leave --steps out (the baseline's count is used), or record a new baseline",
        )
    nproc = baseline.world_size if nproc is None else nproc
    config_text = comparable_config(config, overrides, recorded_steps, nproc)
    was = Layout.of(baseline.config, baseline.world_size, baseline_path)
    will = Layout.of(config_text, nproc, config)
    _require_same_config(baseline_path, baseline.config, config_text)
    _require_comparable_layout(baseline_path, was, will)
    _require_same_device(baseline_path, baseline.environment["device"])
    now = run_smoke(config, overrides, recorded_steps, nproc)
    changes = environment_changes(baseline.environment, now.environment)
    environment = f"environment: {'; '.join(changes) or 'no differences seen'}"
    layout = "" if was == will else f"{will} against {was}; "
    tolerances = metric_tolerances(baseline, now, same_layout=was == will)
    difference = first_difference(baseline, now, tolerances)
    if difference is None:
        return ExitCode.OK, (
            f"smoke: OK: {recorded_steps} steps match {baseline_path} ({layout}"
            f"{_compared(tolerances)}; {environment})"
        )
    by = f" by more than {_percent(difference.tolerance)}" if difference.tolerance else ""
    return ExitCode.ERROR, (
        f"smoke: step {difference.step} {difference.metric} differs{by}: baseline "
        f"{difference.baseline!r} vs now {difference.now!r} ({layout}{environment})"
    )


def metric_tolerances(
    baseline: SmokeRecord, now: SmokeRecord, *, same_layout: bool
) -> dict[str, float | None]:
    """Each metric's relative tolerance: 0 is bit for bit, None not compared."""
    kernels = 0.0 if bit_exact(baseline, now) else KERNEL_TOLERANCE
    if same_layout:
        return {"loss": kernels, "grad_norm": kernels, "peak_memory_gib": PEAK_MEMORY_TOLERANCE}
    # Another layout: the contract's float tolerance; a rank's memory is a share, not the whole.
    return {
        "loss": max(kernels, LAYOUT_TOLERANCE["loss"]),
        "grad_norm": max(kernels, LAYOUT_TOLERANCE["grad_norm"]),
        "peak_memory_gib": None,
    }


def first_difference(
    baseline: SmokeRecord, now: SmokeRecord, tolerances: Mapping[str, float | None]
) -> Difference | None:
    """The first step, and within it the first metric, where ``now`` leaves ``baseline`` by
    more than its tolerance (``metric_tolerances``)."""
    for old, new in zip(baseline.steps, now.steps, strict=True):
        for metric in METRICS:
            tolerance = tolerances[metric]
            a, b = getattr(old, metric), getattr(new, metric)
            if tolerance is not None and not agrees(a, b, tolerance):
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


def comparable_config(config: Path, overrides: Sequence[str], num_steps: int, nproc: int) -> str:
    """The config as the smoke runs it, as TOML, with the paths that only mean something on the
    recording machine replaced: two runs of the same recipe on two machines compare equal. A
    layout the trainer would refuse on ``nproc`` ranks is refused here, before anything runs."""
    smoke_overrides = _smoke_overrides(num_steps, "scratch")
    smoke_overrides += stage_overrides(config, overrides, num_steps)[0]
    cfg = load_config(RunConfig, config, [*overrides, *smoke_overrides])
    check_world(cfg, nproc, nproc)  # local ranks: one host
    local = NOT_COMPARED
    train = replace(cfg.train, run_dir=local)
    if cfg.data.stages is None:
        data = replace(cfg.data, file_list=local, cache=local)
    else:
        stages = tuple(replace(stage, file_list=local) for stage in cfg.data.stages)
        data = replace(cfg.data, stages=stages, cache=local)
    checkpoint = replace(cfg.checkpoint, folder=local, local_dir=None)
    return to_toml(replace(cfg, train=train, data=data, checkpoint=checkpoint))


def run_smoke(config: Path, overrides: Sequence[str], num_steps: int, nproc: int) -> SmokeRecord:
    """``goodput launch --nproc nproc`` of ``goodput train`` of ``config`` for ``num_steps``
    on this machine; its record."""
    config_text = comparable_config(config, overrides, num_steps, nproc)  # a bad one fails here
    kept, note = stage_overrides(config, overrides, num_steps)
    if note:
        print(note, flush=True)
    with tempfile.TemporaryDirectory(prefix="goodput-smoke-") as scratch:
        run_dir = Path(scratch) / "run"
        train = [sys.executable, "-m", "goodput", "train", str(config.absolute()), *overrides]
        train += [*_smoke_overrides(num_steps, scratch), *kept]
        # The generic profile: no site's environment variables in the ranks' numbers.
        launch = ["--nproc", str(nproc), "--profile", "generic"]
        launch += ["--run-dir", str(Path(scratch) / "launch")]
        argv = [sys.executable, "-m", "goodput", "launch", *launch, "--", *train]
        code = subprocess.call(argv, env=_child_environment())
        if code != 0:
            raise GoodputError(
                config,
                f"the smoke run failed (goodput launch --nproc {nproc} of goodput train exited "
                f"with {code})",
                "fix what its output above names, then rerun",
            )
        steps = _read_steps(run_dir / rundir.METRICS, num_steps)
        fingerprint = read_json(run_dir / rundir.RUN_RECORD)["data"]["fingerprint"]
    return SmokeRecord(
        config=config_text,
        world_size=nproc,
        environment=current_environment(fingerprint),
        steps=steps,
    )


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
    checkpoint saved (by steps, time or SIGTERM) or resumed, no memory snapshot, no
    TensorBoard."""
    return [f"train.steps={num_steps}", *_scratch_overrides(scratch)]


def _scratch_overrides(scratch: str) -> list[str]:
    """The smoke's settings but its step count (``_smoke_overrides``)."""
    return [
        f"train.run_dir={json.dumps(str(Path(scratch) / 'run'))}",
        "train.tensorboard=false",
        f"checkpoint.folder={json.dumps(str(Path(scratch) / 'checkpoints'))}",
        "checkpoint.interval_steps=0",
        "checkpoint.interval_minutes=0.0",
        'checkpoint.resume="never"',
        "checkpoint.save_on_sigterm=false",
        "checkpoint.memory_interval_steps=0",
    ]


def stage_overrides(
    config: Path, overrides: Sequence[str], num_steps: int
) -> tuple[list[str], str | None]:
    """The override that keeps the config's data-mix stages that start before the smoke's
    ``num_steps`` (a later one could never start, and the trainer refuses it), with the line
    that says which stages were left out; nothing when every stage is kept."""
    # The run as the smoke runs it, but of its own length.
    cfg = load_config(RunConfig, config, [*overrides, *_scratch_overrides("scratch")])
    if cfg.data.stages is None:
        return [], None
    short = cfg.shortened(num_steps)
    assert short.data.stages is not None
    kept, starts = short.data.stages, cfg.stage_steps()
    if len(kept) == len(starts):
        return [], None
    if short.schedule.decay_start != cfg.schedule.decay_start:
        raise GoodputError.usage(
            config,
            f"schedule.decay_start {cfg.schedule.decay_start!r} names a stage that starts after "
            f"the smoke's {num_steps} steps: its run would differ from the config's",
            f"pass --steps above {cfg.schedule.decay_start_step(starts)}, or tie the decay to "
            "an earlier stage",
        )
    tables = ", ".join(
        f"{{file_list = {json.dumps(stage.file_list)}, start_step = {stage.start_step}}}"
        for stage in kept
    )
    note = (
        f"smoke: {num_steps} steps keep the first {len(kept)} of the config's {len(starts)} "
        f"data-mix stages; the others start after step {starts[len(kept)]} or later"
    )
    return [f"data.stages=[{tables}]"], note


def _child_environment() -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in PLACEMENT_VARIABLES and not name.startswith(ALLOCATION_PREFIXES)
    }
    env["OMP_NUM_THREADS"] = "1"  # each rank's intra-op threads, and MKL's with them
    return env


def _read_steps(metrics_file: Path, num_steps: int) -> tuple[StepValues, ...]:
    """Steps 1..``num_steps`` from the run's metrics; a non-finite value was written as null."""
    lines = runfiles.read_steps(
        metrics_file, require=METRICS, fix="rerun; if it persists, report it"
    )
    steps = [
        StepValues(step=line.step, **{m: line.number(m, math.nan) for m in METRICS})
        for line in lines
    ]
    if [values.step for values in steps] != list(range(1, num_steps + 1)):
        raise GoodputError(
            metrics_file,
            f"the smoke run wrote {len(steps)} step records, not steps 1 to {num_steps}",
            "rerun; if it persists, report it",
        )
    return tuple(steps)


def _require_same_config(path: Path, recorded: str, now: str) -> None:
    # Read through today's RunConfig: a key goodput gained since the recording takes its
    # default on both sides, and only a value that was set differently counts. The layout is
    # _require_comparable_layout's.
    recorded = to_toml(from_table(RunConfig, tomllib.loads(recorded), str(path)))
    layout = {f"parallel.{key}" for key in LAYOUT_KEYS}
    differences = [
        line
        for line in config_diff(tomllib.loads(recorded), tomllib.loads(now))
        if line.partition(":")[0] not in layout
    ]
    if differences:
        more = f" and {len(differences) - 3} more" if len(differences) > 3 else ""
        raise GoodputError.usage(
            path,
            f"was recorded with another config: {'; '.join(differences[:3])}{more}",
            "run the config (and overrides) the baseline was recorded with, or record a new "
            "baseline with --record",
        )


def _require_comparable_layout(path: Path, was: Layout, will: Layout) -> None:
    if was != will and was.world_size > 1:
        raise GoodputError.usage(
            path,
            f"was recorded on {was}, this run would be on {will}: another layout is compared "
            "with a one-process baseline only",
            f"run the baseline's layout (--nproc {was.world_size} and its [parallel] "
            "overrides), or compare with a one-process baseline",
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


def _compared(tolerances: Mapping[str, float | None]) -> str:
    """What was compared how, e.g. ``loss and grad_norm bit for bit, peak memory within 50%``."""

    def how(tolerance: float | None) -> str:
        if tolerance is None:
            return "not compared"
        return "bit for bit" if tolerance == 0 else f"within {_percent(tolerance)}"

    loss, grad_norm = how(tolerances["loss"]), how(tolerances["grad_norm"])
    values = (
        f"loss and grad_norm {loss}" if loss == grad_norm else f"loss {loss}, grad_norm {grad_norm}"
    )
    return f"{values}, peak memory {how(tolerances['peak_memory_gib'])}"


def _layout(record: SmokeRecord) -> Layout:
    return Layout.of(record.config, record.world_size, "the smoke run's config")


def _percent(fraction: float) -> str:
    return f"{100 * fraction:g}%"
