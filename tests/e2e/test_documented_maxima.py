"""Every command whose numbers have documented maxima, and that runs without a cluster, answers
at those maxima within a bound: ``goodput plan layout`` (the machine at 131,072 hosts x 1,024
devices, every ``[model]`` size at its limit, the batch, the sequence, the micro-batch, the
memory and the rates at their ends) and ``plan reliability``, ``model info``, ``launch
--dry-run``, ``submit`` (its script written, not queued) and ``chaos`` (refused at start).

Each runs as a real process, as a user runs it, and must end within ``BOUND_S`` with exit 0 and
an answer, or exit 1 or 2 with one ``goodput: error:`` line: never a traceback, the internal
error line or a timeout. The planner's own bound is far lower (docs/plan.md: seconds on one
core); ``BOUND_S`` is generous for a busy CI machine. ``plan layout --verify`` is left out: it
builds the model for real, each child bounded by ``plan.verify.DEFAULT_TIMEOUT_S``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from goodput import argtypes
from goodput.commands.plan import MAX_GPUS_PER_NODE, MAX_NODES, MAX_RATE, MIN_RATE
from goodput.config import to_toml
from goodput.faults import MAX_FAULTS
from goodput.launch.env import MAX_HOSTS
from goodput.launch.launchers import MAX_PPN
from goodput.launch.submit import MAX_JOBS
from goodput.testing.jobs import REPO, outside_any_job
from goodput.testing.tiny import tiny_run_config
from goodput.train.config import model as model_config

BOUND_S = 60.0
COUNT = argtypes.MAX_COUNT
SECONDS = argtypes.MAX_SECONDS


def _most(limits: dict) -> int:
    return int(limits["limits"].high)


LAYERS, WIDTH, LENGTH = map(_most, (model_config.COUNT, model_config.WIDTH, model_config.LENGTH))
# Every [model] size at its limit (heads divide dim; an even head dim).
LARGEST = {
    "vocab_size": LENGTH,
    "dim": WIDTH,
    "num_layers": LAYERS,
    "num_heads": LAYERS,
    "num_kv_heads": LAYERS,
    "ffn_dim": WIDTH,
    "max_seq_len": LENGTH,
}
LARGEST_MOE = {**LARGEST, "moe": {"num_experts": 2**16, "top_k": 2**16, "expert_ffn_dim": WIDTH}}
MACHINE = ["--nhosts", MAX_NODES, "--ppn", MAX_GPUS_PER_NODE]


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("maxima")
    written = {}
    for name, model in (("largest", LARGEST), ("largest-moe", LARGEST_MOE)):
        written[name] = folder / f"{name}.toml"
        written[name].write_text(_toml(model, "model"))
    written["tiny"] = folder / "tiny.toml"
    written["tiny"].write_text(to_toml(tiny_run_config(folder)))
    written["folder"] = folder
    return written


def _toml(table: dict, name: str) -> str:
    """``table`` as TOML ``[name]`` (its tables as ``[name.key]``): whole numbers only."""
    lines = [f"[{name}]"] + [f"{k} = {v}" for k, v in table.items() if not isinstance(v, dict)]
    inner = [_toml(v, f"{name}.{k}") for k, v in table.items() if isinstance(v, dict)]
    return "\n".join([*lines, *inner]) + "\n"


def layout(config: str, *options: object) -> list[object]:
    return ["plan", "layout", config, *MACHINE, *options]


RATES_HIGH = ["--tflops", MAX_RATE, "--intra-gbps", MAX_RATE, "--inter-gbps", MAX_RATE]
RATES_LOW = ["--tflops", MIN_RATE, "--intra-gbps", MIN_RATE, "--inter-gbps", MIN_RATE]
CASES = {
    # The largest model on the largest machine: the longest sequence, the largest batch of it.
    "layout, largest model": lambda c: layout(
        c["largest"], "--gpu-mem-gb", SECONDS, "--seq-len", LENGTH,
        "--gbs-tokens", COUNT // LENGTH * LENGTH, *RATES_HIGH,
    ),
    "layout, largest model, 80 GiB, slowest rates, --json": lambda c: layout(
        c["largest"], "--gpu-mem-gb", 80, "--seq-len", LENGTH, "--gbs-tokens", LENGTH,
        *RATES_LOW, "--json",
    ),
    "layout, largest micro-batch": lambda c: layout(
        c["largest"], "--gpu-mem-gb", 5e-324, "--seq-len", 8192, "--gbs-tokens", COUNT,
        "--micro-batch-size", COUNT,
    ),
    "layout, largest mixture of experts": lambda c: layout(
        c["largest-moe"], "--gpu-mem-gb", SECONDS, "--seq-len", LENGTH, "--gbs-tokens", LENGTH,
    ),
    "layout, the 405B recipe": lambda c: layout("configs/llama-405b.toml", "--gpu-mem-gb", 80),
    "layout, the 405B at 131,072 tokens": lambda c: layout(
        "configs/llama-405b.toml", "--gpu-mem-gb", 80, "--seq-len", 131072,
        "--gbs-tokens", 131072, "--activation-checkpointing",
    ),
    "reliability": lambda c: [
        "plan", "reliability", "--nhosts", MAX_NODES, "--node-mtbf-days", SECONDS,
        "--save-stall-s", SECONDS, "--restart-s", SECONDS, "--walltime-h", SECONDS,
        "--survival", 0.999999, "--step-s", SECONDS, "--interval-steps", COUNT,
        "--memory-interval-steps", COUNT, "--memory-stall-s", SECONDS, "--json",
    ],
    "reliability, smallest": lambda c: [
        "plan", "reliability", "--nhosts", MAX_NODES, "--node-mtbf-days", 5e-324,
        "--save-stall-s", 5e-324, "--restart-s", 0, "--walltime-h", 5e-324,
        "--survival", 5e-324, "--step-s", 5e-324, "--interval-steps", COUNT,
    ],
    "model info": lambda c: ["model", "info", c["largest-moe"], "--seq-len", COUNT, "--json"],
    "launch --dry-run": lambda c: [
        "launch", "--dry-run", "--ppn", MAX_GPUS_PER_NODE, "--timeout", SECONDS,
        "--startup-timeout", SECONDS, "--retries", COUNT, "--backoff", SECONDS,
        "--grace", SECONDS, "--", "true",
    ],
    "launch --dry-run, most ranks": lambda c: [
        "launch", "--dry-run", "--nhosts", COUNT, "--ppn", COUNT, "--nproc", COUNT, "--", "true",
    ],
    "submit": lambda c: [
        "submit", "--run-dir", c["folder"] / "chain", "--nhosts", MAX_HOSTS, "--time",
        "99:59:59", "--max-jobs", MAX_JOBS, "--scheduler", "slurm", "--", "goodput", "launch",
        "--ppn", MAX_PPN, "--", "true",
    ],
    "submit, past its maxima": lambda c: [
        "submit", "--run-dir", c["folder"] / "chain2", "--nhosts", COUNT, "--time", "01:00:00",
        "--max-jobs", COUNT, "--scheduler", "slurm", "--", "goodput", "launch", "--", "true",
    ],
    "chaos": lambda c: [
        "chaos", c["tiny"], "--faults", MAX_FAULTS, "--seed", COUNT, "--nproc", 2,
        "--output", c["folder"] / "campaign",
    ],
    "chaos, most ranks": lambda c: [
        "chaos", c["tiny"], "--faults", 1, "--nproc", COUNT, "--output", c["folder"] / "c2",
    ],
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_command_at_its_maxima_answers_in_time(configs, case):
    argv = [sys.executable, "-m", "goodput", *map(str, CASES[case](configs))]
    began = time.monotonic()
    try:
        done = subprocess.run(
            argv, cwd=REPO, env=outside_any_job(), capture_output=True, text=True, timeout=BOUND_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"no answer in {BOUND_S:g} s: {' '.join(argv[3:])}")
    took = time.monotonic() - began
    said = done.stderr
    assert "Traceback" not in said and "report it" not in said, said
    if done.returncode == 0:
        assert done.stdout.strip(), argv
    else:
        assert done.returncode in (1, 2), (argv, said)
        assert said.startswith("goodput: error: ") and said.count("\n") == 1, said
    print(f"{case}: exit {done.returncode} in {took:.1f} s {said[:160]}")
