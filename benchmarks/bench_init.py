"""Start-up of a fresh run: time and peak memory per rank against model size, the sharded init
(``goodput.train.init``: built on the meta device, each rank fills its own shard) against the
build-then-cut it replaced (every rank draws the whole model in fp32, then FSDP keeps its
shard); and ``goodput plan layout --verify`` on each recipe (one rank of the real machine
materialised on this CPU).

Sizes: Llama shapes of about 125M, 350M and 1B parameters (vocab 32,000), fp32, FSDP over 4
gloo ranks on this machine. Method: every measurement is one fresh set of 4 spawned ranks
(peak resident memory is a process's high-water mark, so a process measures one build); each
rank reports the seconds ``build_model`` took and the growth of its peak RSS over it; a run's
figure is the slowest rank's time and the largest rank's growth; ``REPEATS`` runs per method
and size, alternating methods, the median reported, with the ratio baseline / sharded of the
medians. The shard's own bytes (its parameters) are given beside the peaks: the sharded build
stays within the shard plus one 256 KiB block and the allocator's slack.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from goodput.testing.dist import run_distributed
from goodput.testing.jobs import REPO
from goodput.testing.recipes import RECIPES, recipe_machine
from goodput.testing.tiny import tiny_run_config
from goodput.train.build import build_model, context_layout
from goodput.train.config.model import ModelConfig
from goodput.train.config.run import RunConfig, plan_batches
from goodput.train.device import process_peak_bytes, reset_process_peak
from goodput.train.model import Transformer
from goodput.train.parallel.mesh import build_mesh
from goodput.train.parallel.parallelize import parallelize

RANKS = 4
REPEATS = 3
SIZES = {
    "125M": ModelConfig(
        vocab_size=32000, dim=768, num_layers=12, num_heads=12, num_kv_heads=4, ffn_dim=2048
    ),
    "350M": ModelConfig(
        vocab_size=32000, dim=1024, num_layers=24, num_heads=16, num_kv_heads=4, ffn_dim=2816
    ),
    "1B": ModelConfig(
        vocab_size=32000, dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, ffn_dim=5632
    ),
}


def build_then_cut(cfg: RunConfig, device: torch.device, mesh: Any) -> torch.nn.Module:
    """The start-up this replaced: the whole model drawn on every rank, then laid out."""
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        whole = Transformer(cfg.model)
    return parallelize(whole, cfg.parallel, mesh, context=context_layout(cfg, mesh))


def measure(rank: int, world_size: int, cfg: RunConfig, method: str) -> dict[str, float]:
    device = torch.device("cpu")
    mesh = build_mesh(cfg.parallel, device, ranks_per_host=world_size)
    plan = plan_batches(cfg.train, mesh.dp_size)
    reset_process_peak()  # a spawned rank starts with its own peak: VmHWM, not ru_maxrss
    before = process_peak_bytes()
    start = time.perf_counter()
    if method == "sharded":
        model = build_model(cfg, device, mesh, plan, empty=False)
    else:
        model = build_then_cut(cfg, device, mesh)
    seconds = time.perf_counter() - start
    growth = process_peak_bytes() - before
    shard = sum(4 * p.to_local().numel() for p in model.parameters())
    return {"seconds": seconds, "peak_growth_bytes": growth, "shard_bytes": shard}


def one_size(tmp: Path, model: ModelConfig) -> dict[str, Any]:
    base = tiny_run_config(tmp)
    cfg = replace(
        base,
        model=model,
        train=replace(base.train, tokens_per_step=RANKS * base.train.seq_len, micro_batch_size=1),
        parallel=replace(base.parallel, dp_shard=RANKS),
    )
    runs: dict[str, list[dict[str, float]]] = {"sharded": [], "build_then_cut": []}
    for _ in range(REPEATS):
        for method in runs:
            ranks = run_distributed(measure, RANKS, cfg, method, timeout_s=1800)
            runs[method].append(
                {
                    "seconds": max(r["seconds"] for r in ranks),
                    "peak_growth_bytes": max(r["peak_growth_bytes"] for r in ranks),
                    "shard_bytes": max(r["shard_bytes"] for r in ranks),
                }
            )
    with torch.device("meta"):
        num_parameters = sum(p.numel() for p in Transformer(model).parameters())
    result: dict[str, Any] = {"parameters": num_parameters}
    for method, figures in runs.items():
        result[method] = {key: statistics.median(run[key] for run in figures) for key in figures[0]}
    for key in ("seconds", "peak_growth_bytes"):
        result[f"{key}_ratio_baseline_over_sharded"] = (
            result["build_then_cut"][key] / result["sharded"][key]
        )
    return result


def verify_recipe(recipe: Path) -> dict[str, Any]:
    """``goodput plan layout RECIPE --layout-from-config --verify --json`` on the recipe's
    machine, as a user runs it."""
    command = [
        sys.executable, "-m", "goodput", "plan", "layout", str(recipe.relative_to(REPO)),
        *recipe_machine(recipe).plan_options(), "--layout-from-config", "--verify", "--json",
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=1800, check=True, cwd=REPO
    )
    verified = json.loads(done.stdout)["verified"]
    return {"wall_seconds": time.perf_counter() - start, **verified}


def main() -> dict[str, Any]:
    results: dict[str, Any] = {"ranks": RANKS, "repeats": REPEATS}
    with tempfile.TemporaryDirectory(prefix="goodput-bench-init-") as tmp:
        for name, model in SIZES.items():
            directory = Path(tmp) / name
            directory.mkdir()
            results[name] = one_size(directory, model)
            print(f"init {name}: {json.dumps(results[name])}", flush=True)
    results["verify"] = {}
    for recipe in RECIPES:
        results["verify"][recipe.stem] = verify_recipe(recipe)
        print(
            f"init verify {recipe.stem}: {json.dumps(results['verify'][recipe.stem])}", flush=True
        )
    return results
