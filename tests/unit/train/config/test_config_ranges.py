"""Each config key's limits are its real working range, and a key that cannot take effect is
refused: hostile values at load, where they used to pass and fail (or never end) on a rank."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from goodput.config import load_config, to_toml
from goodput.errors import ExitCode, GoodputError
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import tiny_run_config
from goodput.train.config.parallel import ParallelConfig, pipeline_microbatches
from goodput.train.config.run import RunConfig

CONFIGS = Path(__file__).parents[4] / "configs"
TINY = CONFIGS / "tiny-cpu.toml"


def refusal(overrides: list[str]) -> str:
    with pytest.raises(GoodputError) as error:
        load_config(RunConfig, TINY, overrides)
    assert error.value.code == ExitCode.USAGE
    line = error.value.render()
    assert "\n" not in line
    return line


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # 10**9 Newton-Schulz iterations: a step that never ends.
        (
            ["optim.kind=muon", "optim.muon_ns_steps=1000000000"],
            "'optim.muon_ns_steps' = 1000000000 is not in [1, 20]",
        ),
        # The loss window: LossSpikes takes at most 2**16 and needs 20 losses of history.
        (
            ["diagnostics.loss_spike_window=65537"],
            "'diagnostics.loss_spike_window' = 65537 is not in [20, 65536]",
        ),
        (["diagnostics.loss_spike_window=10"], "is not in [20, 65536]"),
        # numpy's global seed takes 32 bits (setup_torch seeds it on every rank).
        (["train.seed=4294967296"], "'train.seed' = 4294967296 is not in [0, 4294967295]"),
        # The whole run's blend would exceed what a blend holds.
        (["train.steps=9007199254740992"], "more than a blend holds"),
        # [watch]: at a ratio of 1 every rank is a straggler; a window of 1 step is noise.
        (["watch.straggler_ratio=1"], "'watch.straggler_ratio' = 1 is not in (1, 100]"),
        (["watch.straggler_ratio=nan"], "'watch.straggler_ratio' = nan is not in (1, 100]"),
        (["watch.straggler_ratio=inf"], "is not in (1, 100]"),
        (["watch.straggler_steps=1"], "'watch.straggler_steps' = 1 is not in [2, 10000]"),
        (["watch.straggler_steps=10001"], "is not in [2, 10000]"),
        (["watch.straggler_steps=2.5"], "'watch.straggler_steps' must be int"),
        # No world size mends a micro-batch that does not divide the global batch.
        (["train.micro_batch_size=5"], "does not split into micro-batches of 5"),
    ],
)
def test_a_value_a_rank_would_refuse_or_never_finish_is_refused_at_load(overrides, message):
    assert message in refusal(overrides)


def test_the_limits_admit_their_whole_range():
    cfg = load_config(
        RunConfig,
        TINY,
        [
            "optim.kind=muon",
            "optim.muon_ns_steps=20",
            "diagnostics.loss_spike_window=65536",
            "train.seed=4294967295",
            "watch.straggler_ratio=100",
            "watch.straggler_steps=10000",
        ],
    )
    assert (cfg.optim.muon_ns_steps, cfg.train.seed) == (20, 2**32 - 1)
    assert (cfg.watch.straggler_ratio, cfg.watch.straggler_steps) == (100, 10_000)


# (overrides, the key refused, what enables it)
INERT = [
    (["parallel.pp_schedule=gpipe"], "parallel.pp_schedule", "pp > 1"),
    (["parallel.pp_microbatches=4"], "parallel.pp_microbatches", "pp > 1"),
    (["parallel.pp_layers_per_stage=[2, 2]"], "parallel.pp_layers_per_stage", "pp > 1"),
    (["parallel.pp_schedule=interleaved_1f1b"], "parallel.pp_schedule", "pp > 1"),
    (["parallel.loss_parallel=false"], "parallel.loss_parallel", "tp > 1"),
    (
        [
            'parallel.data_parallel="replicate"',
            'parallel.precision="fp32"',
            "parallel.sync_every_micro_batch=true",
        ],
        "parallel.sync_every_micro_batch",
        "data_parallel = 'fsdp'",
    ),
    (["optim.muon_ns_steps=7"], "optim.muon_ns_steps", "kind = 'muon'"),
    (["optim.kind=mano", "optim.muon_lr_rule=spectral"], "optim.muon_lr_rule", "kind = 'muon'"),
    (["optim.momentum=0.9"], "optim.momentum", "kind = 'muon' or kind = 'mano'"),
    (["optim.sophia_rho=0.1"], "optim.sophia_rho", "kind = 'sophiag'"),
    (["optim.sophia_hessian_interval=3"], "optim.sophia_hessian_interval", "kind = 'sophiag'"),
    (["optim.lamb_max_weight_norm=3.0"], "optim.lamb_max_weight_norm", "kind = 'lamb'"),
    (["optim.kind=sophiag", "optim.eps=1e-6"], "optim.eps", "kind = 'adamw'"),
    (["schedule.decay_fraction=0.5"], "schedule.decay_fraction", "kind = 'wsd'"),
    (["metrics.wandb_project=x"], "metrics.wandb_project", "wandb = true"),
    (
        ["diagnostics.freeze_check_interval=0", "diagnostics.freeze_threshold=0.3"],
        "diagnostics.freeze_threshold",
        "freeze_check_interval > 0",
    ),
    (["eval.task_items=5"], "eval.task_items", "tasks"),
    (["eval.alarm_evals=5"], "eval.alarm_evals", "tasks"),
    (["model.rope_scaling_factor=4.0"], "model.rope_scaling_factor", "rope_scaling = 'linear'"),
    (
        [
            "model.rope_scaling=linear",
            "model.rope_scaling_factor=4.0",
            "model.rope_original_max_seq_len=64",
        ],
        "model.rope_original_max_seq_len",
        "rope_scaling = 'llama3'",
    ),
]


@pytest.mark.parametrize(("overrides", "key", "enabled_by"), INERT)
def test_a_key_that_cannot_take_effect_is_refused_naming_what_enables_it(
    overrides, key, enabled_by
):
    line = refusal(overrides)
    assert f"'{key}' is set but has no effect: it needs {enabled_by}" in line


def test_the_same_keys_load_where_they_take_effect():
    load_config(RunConfig, TINY, ["parallel.pp=2", "parallel.pp_schedule=gpipe"])
    load_config(RunConfig, TINY, ["optim.kind=muon", "optim.muon_ns_steps=7"])
    load_config(RunConfig, TINY, ["optim.kind=sophiag", "optim.sophia_rho=0.1"])
    load_config(RunConfig, TINY, ["schedule.kind=wsd", "schedule.decay_fraction=0.5"])
    load_config(RunConfig, TINY, ["model.rope_scaling=llama3", "model.rope_scaling_factor=8.0"])


def test_a_key_at_its_default_is_never_refused_so_a_resolved_config_loads_back(tmp_path):
    """A resolved config.toml spells out every key, the inert ones at their defaults."""
    cfg = load_config(RunConfig, TINY, ["parallel.pp_schedule=1f1b", "optim.momentum=0.95"])
    resolved = tmp_path / "config.toml"
    resolved.write_text(to_toml(cfg))
    assert "pp_schedule" in resolved.read_text() and "muon_ns_steps" in resolved.read_text()
    assert load_config(RunConfig, resolved) == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("parallel.pp_microbatches=4", "'parallel.pp_microbatches' is set but has no effect"),
        ("train.seed=-1", "'train.seed' = -1 is not in [0, 4294967295]"),
    ],
)
def test_goodput_train_refuses_in_one_line_before_any_work(tmp_path, override, message):
    run = subprocess.run(
        [sys.executable, "-m", "goodput", "train", str(TINY), override],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == ExitCode.USAGE, run.stderr
    assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written: no run dir, no blend cache


def _refusal_of_train(rank: int, world_size: int, cfg: RunConfig) -> str | None:
    from goodput.train.loop import train

    try:
        train(cfg)
    except GoodputError as error:
        return error.render()
    return None


def test_pipeline_microbatches_that_cannot_divide_are_refused_before_the_blend(tmp_path):
    """Needs the world size, so not at load: at start, before rank 0 builds the blend."""
    cfg = tiny_run_config(tmp_path)  # a global batch of 8 samples
    cfg = replace(cfg, parallel=replace(cfg.parallel, pp=2, pp_microbatches=3))
    refusals = run_distributed(_refusal_of_train, 2, cfg, timeout_s=240)
    assert all("pp_microbatches = 3 does not divide the 8 samples" in r for r in refusals)
    assert not Path(cfg.data.cache).exists() and not Path(cfg.train.run_dir).exists()


@pytest.mark.parametrize(
    ("schedule", "count", "needs"),
    [
        ("1f1b", 1, "needs at least pp = 2"),
        ("interleaved_1f1b", 5, "a multiple of its 2 rounds"),
        ("interleaved_zb", 5, "a multiple of its 2 rounds"),
        ("dualpipev", 2, "needs at least one per stage, 2 x pp = 4"),
    ],
)
def test_micro_batches_a_pipeline_schedule_refuses_are_refused_with_the_batch_plan(
    schedule, count, needs
):
    """torch's schedules refuse these when built; the loop asks before the blend is built."""
    cfg = ParallelConfig(precision="fp32", pp=2, pp_schedule=schedule, pp_microbatches=count)
    with pytest.raises(GoodputError) as error:
        pipeline_microbatches(cfg, local_batch_size=10, default=1)
    assert needs in error.value.render() and error.value.code == ExitCode.USAGE
    assert pipeline_microbatches(replace(cfg, pp_schedule="gpipe"), 10, default=1) == count
