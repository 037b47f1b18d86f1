"""Fuzz the run config against the checks a rank makes later: what loads, runs.

Property: a config that ``load_config`` accepts passes every run-time check that depends on the
config alone — the batch plan, the diagnostics' trackers, the seeds, the model built (on the
meta device), an optimizer step of its kind (in bounded time: no iteration count that never
ends), the blend's sample count, the schedule's LR — so no rank can refuse, or hang on, a config
after the others started. Inputs: the shipped tiny config with each numeric key overridden
(and up to two more), drawn from the ranges' edges and beyond.
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from goodput.config import load_config
from goodput.data.interleave import MAX_SAMPLES
from goodput.errors import GoodputError
from goodput.testing.wire import in_lockstep
from goodput.train.config.run import RunConfig, plan_batches
from goodput.train.config.schedule import learning_rate
from goodput.train.model import Transformer
from goodput.train.monitor.freeze import FreezeDetector
from goodput.train.monitor.loss_spikes import LossSpikes
from goodput.train.monitor.noise_scale import NoiseScale
from goodput.train.monitor.stragglers import StragglerWatch
from goodput.train.optim.optimizers import Optimizers
from goodput.train.step_vote import Ballot, cast

TINY = Path(__file__).parents[2] / "configs" / "tiny-cpu.toml"
STEP_BUDGET_S = 5.0  # one optimizer step on two 8x8 matrices, whatever the config

NUMERIC_KEYS = [
    "train.steps",
    "train.tokens_per_step",
    "train.seq_len",
    "train.micro_batch_size",
    "train.seed",
    "train.max_grad_norm",
    "optim.muon_ns_steps",
    "optim.sophia_hessian_interval",
    "optim.sophia_rho",
    "optim.lamb_max_weight_norm",
    "optim.momentum",
    "optim.eps",
    "optim.weight_decay",
    "optim.qk_clip",
    "diagnostics.freeze_check_interval",
    "diagnostics.freeze_threshold",
    "diagnostics.loss_spike_window",
    "diagnostics.loss_spike_z",
    "diagnostics.gns_ema",
    "schedule.lr",
    "schedule.warmup_steps",
    "schedule.min_lr_ratio",
    "schedule.decay_fraction",
    "eval.interval_steps",
    "eval.holdout_samples",
    "watch.straggler_ratio",
    "watch.straggler_steps",
]
EDGES = [0, 1, 2, 5, 19, 20, 21, 64, 128, 2**16, 2**16 + 1, 2**31, 2**32 - 1, 2**32, 2**46]
EDGES += [2**53, 10**9, 0.5, 0.999, 1e-300, 1e9]
kinds = st.sampled_from(["adamw", "lamb", "sophiag", "muon", "mano"])
values = st.one_of(
    st.sampled_from(EDGES),
    st.integers(min_value=0, max_value=2**53),
    st.floats(min_value=0, max_value=2**53, allow_nan=False),
)
others = st.lists(st.tuples(st.sampled_from(NUMERIC_KEYS), values), max_size=2).map(
    lambda pairs: [f"{key}={value!r}" for key, value in pairs]
)


def passes_run_time_checks(cfg: RunConfig) -> None:
    """What a rank does with the config before and in its first step, on one rank."""
    train, diagnostics = cfg.train, cfg.diagnostics
    plan = plan_batches(train, dp_size=1)
    assert train.steps * plan.global_batch_size <= MAX_SAMPLES  # the blend can be built
    random.seed(train.seed)  # setup_torch's seeds
    np.random.seed(train.seed)
    torch.manual_seed(train.seed)
    LossSpikes(diagnostics.loss_spike_window, diagnostics.loss_spike_z)
    NoiseScale(diagnostics.gns_ema)
    matrices = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    if diagnostics.freeze_check_interval:
        FreezeDetector(
            list(matrices.named_parameters()),
            diagnostics.freeze_check_interval,
            diagnostics.freeze_threshold,
        )
    with torch.device("meta"):
        Transformer(cfg.model)
    optimizer = Optimizers([matrices], cfg.optim, cfg.schedule.lr)
    matrices(torch.randn(2, 8)).sum().backward()
    started = time.perf_counter()
    optimizer.step()
    assert time.perf_counter() - started < STEP_BUDGET_S
    for step in (0, train.steps - 1):
        assert math.isfinite(learning_rate(cfg.schedule, step, train.steps))
    # Two ranks' watches over a whole window (judged), rank 1 at 1 s a step, rank 0 at 0.
    with tempfile.TemporaryDirectory() as run_dir:

        def watch(wire):
            stragglers = StragglerWatch(cfg.watch, ["a", "b"], wire, run_dir=Path(run_dir))
            for step in range(0, cfg.watch.straggler_steps + 1):  # step 0: warm-up
                ballot = Ballot(
                    sigterm=False, minutes_due=False, snapshot_ok=True, busy_s=float(wire.rank)
                )
                stragglers.observe(step, ballot.busy_s, cast(wire, ballot).busy)

        in_lockstep(watch, 2)


@pytest.mark.parametrize("key", NUMERIC_KEYS)
@given(kind=kinds, value=values, items=others)
def test_a_config_that_loads_passes_every_run_time_check(key, kind, value, items):
    try:
        cfg = load_config(RunConfig, TINY, [f"optim.kind={kind}", f"{key}={value!r}", *items])
    except GoodputError as error:
        assert error.render().count("\n") == 0
        return
    passes_run_time_checks(cfg)
