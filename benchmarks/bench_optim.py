"""Optimizers and the in-loop diagnostics on CPU, each against its baseline in the same run.

- ``step``: one optimizer step of every ``[optim] kind`` on the same model and gradients
  (dim 384, 4 layers, vocab 4,096: 9.4M parameters, fp32, one process, both cores), against
  AdamW's (``foreach``). Ratio = kind / AdamW, the median over ``STEP_ROUNDS`` rounds of each
  round's ratio (< 1.15 is the target for Mano). SophiaG's row is
  its step alone; its Hessian estimate (one more forward and backward every
  ``sophia_hessian_interval`` steps) is a training-step cost, not an optimizer one.
- ``muon_distributed``: Muon on 4 gloo ranks of one thread holding the same plain matrices, the
  Newton-Schulz work split over them (``distribute=True``) against every rank doing every
  matrix (``distribute=False``). An iteration's time is its slowest rank's. Ratio = baseline /
  ours (> 1: faster). 4 ranks share 2 cores here, so the ratio shows the work removed, not a
  4-GPU speed-up.
- ``lr_find``: ``goodput diagnose lr-find``'s ramp on the tiny test run against the same number
  of training steps of ``goodput train`` (ratio = lr-find / train), and the 5-run learning-rate
  sweep it replaces (5 x that train run, the sweep's cheapest form).
- ``diagnostics``: the forward and backward of a step on 2 ranks (FSDP, the tiny model widened
  to dim 256, 512 tokens a rank), a model whose reduce-scatters tally each rank's own gradient
  (``parallelize(..., tally=)``, as the trainer builds it) against an identical one without (the
  noise scale's cost), and one bf16 freeze check (the optimizer step it watches included)
  spread over its interval of 100 steps; each as a share of the step (target <= 1%).

Median of ``REPEATS`` timed repetitions after ``WARMUP``; the rows of one comparison take turns.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from goodput.diagnose.lr_find import RampSettings, lr_find
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL, tiny_run_config, uneven_global_batch
from goodput.train.config.model import ModelConfig
from goodput.train.config.optim import OptimConfig
from goodput.train.config.parallel import ParallelConfig
from goodput.train.loop import train
from goodput.train.model import Transformer
from goodput.train.monitor.freeze import FreezeDetector
from goodput.train.optim.muon import Muon
from goodput.train.optim.optimizers import Optimizers, matrix_groups
from goodput.train.parallel.grad_tally import GradientTally
from goodput.train.parallel.parallelize import parallelize
from goodput.train.step import forward_backward

MODEL = ModelConfig(
    vocab_size=4096, dim=384, num_layers=4, num_heads=6, num_kv_heads=6, ffn_dim=1024
)
KINDS = ("adamw", "lamb", "sophiag", "muon", "mano")
WARMUP = 3
REPEATS = 15
STEP_ROUNDS = 41
LR_FIND_STEPS = 60
FREEZE_INTERVAL = 100


def _model_with_grads(cfg: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter) * 1e-3
    return model


def _median_s(run: Any) -> float:
    times = []
    for index in range(WARMUP + REPEATS):
        start = time.perf_counter()
        run()
        if index >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _step_times() -> tuple[dict[str, float], dict[str, float]]:
    """(median step time per kind, median over rounds of each round's kind / AdamW ratio): a
    round runs AdamW and the kinds of its set once each, back to back, so a noisy moment hits
    one round's ratios alike. Muon has rounds of its own: its bf16 Newton-Schulz, 6-9x longer,
    disturbed the kind stepped after it."""
    model = _model_with_grads(MODEL)
    medians: dict[str, float] = {}
    ratios: dict[str, float] = {}
    for kinds in (("adamw", "lamb", "sophiag", "mano"), ("adamw", "muon")):
        optimizers = {kind: Optimizers([model], OptimConfig(kind=kind), 1e-4) for kind in kinds}
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for index in range(WARMUP + STEP_ROUNDS):
            for kind, optimizer in optimizers.items():
                start = time.perf_counter()
                optimizer.step()
                if index >= WARMUP:
                    times[kind].append(time.perf_counter() - start)
        for kind in kinds[1:]:
            medians[kind] = statistics.median(times[kind])
            pairs = zip(times[kind], times["adamw"], strict=True)
            ratios[kind] = statistics.median(ours / adamw for ours, adamw in pairs)
        medians.setdefault("adamw", statistics.median(times["adamw"]))
    ratios["adamw"] = 1.0
    return medians, ratios


def _muon_rank(rank: int, world_size: int) -> dict[str, float]:
    torch.set_num_threads(1)
    model = _model_with_grads(MODEL)
    groups = matrix_groups(model, 0.1)
    ours = Muon(groups, lr=1e-4, replica_group=dist.group.WORLD)
    baseline = Muon(matrix_groups(model, 0.1), lr=1e-4, distribute=False)
    return {"distributed_s": _median_s(ours.step), "every_rank_s": _median_s(baseline.step)}


def _lr_find_against_train() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        cfg = tiny_run_config(root)
        cfg = replace(cfg, train=replace(cfg.train, steps=LR_FIND_STEPS, tensorboard=False))
        start = time.perf_counter()
        train(cfg)
        train_s = time.perf_counter() - start
        ramp_cfg = replace(cfg, train=replace(cfg.train, run_dir=str(root / "ramp")))
        settings = RampSettings(num_steps=LR_FIND_STEPS, min_lr=1e-6, max_lr=10.0)
        start = time.perf_counter()
        found = lr_find(ramp_cfg, settings)
        ramp_s = time.perf_counter() - start
    return {
        "train_s": train_s,
        "lr_find_s": ramp_s,
        "lr_find_steps_run": len(found.curve),
        "ratio_lr_find_to_train": ramp_s / train_s,
        "ratio_lr_find_to_5_run_sweep": ramp_s / (5 * train_s),
    }


def _diagnostics_rank(rank: int, world_size: int) -> dict[str, float]:
    torch.set_num_threads(1)
    cfg = replace(TINY_MODEL, dim=256, ffn_dim=512, num_heads=4)
    layout = ParallelConfig(precision="fp32")  # FSDP over the 2 ranks
    tally = GradientTally()
    models = {}
    for name, own in (("plain", None), ("tallied", tally)):
        torch.manual_seed(0)
        models[name] = parallelize(Transformer(cfg), layout, tally=own)
    inputs, labels = uneven_global_batch(16, 64, TINY_MODEL.vocab_size)
    mine = [(inputs[rank::2], labels[rank::2])]
    times: dict[str, list[float]] = {"plain": [], "tallied": []}
    for index in range(WARMUP + REPEATS):  # the two take turns
        for name, model in models.items():
            start = time.perf_counter()
            forward_backward(model, mine, tally=tally if name == "tallied" else None)
            model.zero_grad()
            if index >= WARMUP:
                times[name].append(time.perf_counter() - start)
    # The tally's own work, alone: one pass over a buffer of every local gradient (what FSDP
    # reduce-scatters), which the A/B above cannot resolve from the step's noise.
    local_gradients = torch.randn(sum(p.numel() for p in models["plain"].parameters()))
    tally_pass_s = _median_s(lambda: GradientTally().add(local_gradients))
    model = models["plain"]
    detector = FreezeDetector(list(model.named_parameters()), interval=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    check_times = []
    for _ in range(5):
        forward_backward(model, mine)
        start = time.perf_counter()
        detector.before_step()
        optimizer.step()
        detector.after_step(1)
        check_times.append(time.perf_counter() - start)
    return {
        "step_s": statistics.median(times["plain"]),
        "tallied_step_s": statistics.median(times["tallied"]),
        "tally_pass_s": tally_pass_s,
        "freeze_check_s": statistics.median(check_times),
    }


def main() -> dict[str, Any]:
    torch.set_num_threads(2)
    steps, ratios = _step_times()
    figures: dict[str, Any] = {"step_s": steps, "ratio_to_adamw": ratios}
    per_rank = run_distributed(_muon_rank, 4, timeout_s=900)
    muon = {key: max(rank[key] for rank in per_rank) for key in per_rank[0]}
    muon["ratio"] = muon["every_rank_s"] / muon["distributed_s"]
    figures["muon_distributed_4_ranks"] = muon
    figures["lr_find"] = _lr_find_against_train()
    per_rank = run_distributed(_diagnostics_rank, 2, timeout_s=900)
    diagnostics = {key: max(rank[key] for rank in per_rank) for key in per_rank[0]}
    diagnostics["gns_ab_difference"] = diagnostics["tallied_step_s"] / diagnostics["step_s"] - 1
    diagnostics["gns_share_of_step"] = diagnostics["tally_pass_s"] / diagnostics["step_s"]
    diagnostics["freeze_share_of_step"] = diagnostics["freeze_check_s"] / (
        FREEZE_INTERVAL * diagnostics["step_s"]
    )
    figures["diagnostics"] = diagnostics
    num_parameters = sum(p.numel() for p in Transformer(MODEL).parameters())
    print(
        f"optim: step time against AdamW, {num_parameters:,} parameters, median of "
        f"{STEP_ROUNDS} rounds"
    )
    for kind in KINDS:
        print(f"  {kind:8s} {steps[kind] * 1e3:8.1f} ms  {figures['ratio_to_adamw'][kind]:.2f}x")
    print(
        f"  muon, 4 ranks: Newton-Schulz split {muon['distributed_s'] * 1e3:.0f} ms, every rank "
        f"all {muon['every_rank_s'] * 1e3:.0f} ms: {muon['ratio']:.2f}x"
    )
    lr = figures["lr_find"]
    print(
        f"  lr-find {lr['lr_find_s']:.1f} s ({lr['lr_find_steps_run']} steps) against "
        f"{LR_FIND_STEPS} training steps {lr['train_s']:.1f} s: {lr['ratio_lr_find_to_train']:.2f}x"
        f"; against a 5-run sweep {lr['ratio_lr_find_to_5_run_sweep']:.2f}x"
    )
    print(
        f"  gns tally {100 * diagnostics['gns_share_of_step']:.2f}% of a step (A/B of whole "
        f"steps: {100 * diagnostics['gns_ab_difference']:+.1f}%, within noise); freeze check "
        f"{diagnostics['freeze_check_s'] * 1e3:.1f} ms every {FREEZE_INTERVAL} steps = "
        f"{100 * diagnostics['freeze_share_of_step']:.3f}% of a step"
    )
    return figures
