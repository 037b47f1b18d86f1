"""The loop end to end on a real blend: run directory, metrics, the step line, the same losses
for any DP size and accumulation split, and options that must not change the numbers."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from goodput.config import load_config
from goodput.testing.dist import run_distributed
from goodput.train.config.run import RunConfig
from goodput.train.flops import flops_per_token
from goodput.train.loop import train


def with_train(cfg, **changes):
    return replace(cfg, train=replace(cfg.train, **changes))


def with_parallel(cfg, output, **changes):
    return replace(
        cfg,
        train=replace(cfg.train, run_dir=str(output)),
        parallel=replace(cfg.parallel, **changes),
    )


def test_a_run_trains_and_writes_its_run_directory(run_config, capsys):
    losses = train(run_config)
    out = capsys.readouterr().out
    run_dir = Path(run_config.train.run_dir)
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5
    step_lines = [line for line in out.splitlines() if line.startswith("step=")]
    assert [line.split()[0] for line in step_lines] == [f"step={n}" for n in range(1, 9)]
    assert "warning" not in out  # a fresh model starts at ln(vocab)

    assert load_config(RunConfig, run_dir / "config.toml") == run_config
    record = json.loads((run_dir / "run.json").read_text())
    assert record["world_size"] == 1 and record["packages"]["torch"].startswith("2.13")
    assert record["git_sha"] and len(record["data"]["fingerprint"]) == 64
    last_beat = json.loads((run_dir / "heartbeat").read_text())  # the run is complete: done
    assert (last_beat["step"], last_beat["done"]) == (8, True) and (run_dir / "done").exists()

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert [m["loss"] for m in metrics] == losses
    last = metrics[-1]
    assert last["tokens_per_s"] == pytest.approx(128 / last["step_time_s"])
    # peak_tflops = 1 in the fixture: MFU is FLOPs/token x tokens/s over 1e12.
    expected_mfu = flops_per_token(run_config.model, 16) * last["tokens_per_s_per_device"] / 1e12
    assert last["mfu"] == pytest.approx(expected_mfu)
    assert last["peak_memory_gib"] > 0 and last["lr"] < metrics[1]["lr"]


def test_tensorboard_events_hold_the_losses(run_config):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = train(run_config)
    events = EventAccumulator(str(Path(run_config.train.run_dir) / "tensorboard"))
    events.Reload()
    logged = [event.value for event in events.Scalars("train/loss")]
    assert logged == pytest.approx(losses, rel=1e-6)


def train_on_rank(rank, world_size, cfg):
    return train(cfg)


def test_losses_equal_for_any_dp_size_and_accumulation(run_config, tmp_path):
    reference = train(run_config)
    accumulated = train(with_train(run_config, micro_batch_size=1, run_dir=str(tmp_path / "a")))
    assert accumulated == pytest.approx(reference, rel=1e-5)
    two_ranks = run_distributed(
        train_on_rank, 2, with_train(run_config, run_dir=str(tmp_path / "b"))
    )
    for losses in two_ranks:
        assert losses == pytest.approx(reference, rel=1e-5)


def test_activation_checkpointing_changes_nothing_but_memory(run_config, tmp_path, capsys):
    reference = train(run_config)
    for mode in ("full", "op"):  # recompute is exact: the same losses, bit for bit
        checkpointed = with_parallel(run_config, tmp_path / mode, activation_checkpointing=mode)
        assert train(checkpointed) == reference, mode
    # The deprecated [train] key still works, and says so.
    deprecated = with_train(run_config, activation_checkpointing=True, run_dir=str(tmp_path / "d"))
    assert "[train] activation_checkpointing is deprecated" in capsys.readouterr().err
    assert deprecated.parallel.activation_checkpointing == "full"
    assert train(deprecated) == reference


def test_compiled_blocks_train_the_same(run_config, tmp_path):
    reference = train(with_train(run_config, steps=3))
    compiled = train(with_parallel(with_train(run_config, steps=3), tmp_path / "c", compile=True))
    assert compiled == pytest.approx(reference, rel=1e-4)
    # What the partitioner recomputes within a memory budget is as exact as what it keeps.
    budgeted = with_parallel(
        with_train(run_config, steps=3),
        tmp_path / "b",
        compile=True,
        activation_checkpointing="budget",
        activation_memory_budget=0.3,
    )
    assert train(budgeted) == pytest.approx(reference, rel=1e-4)


def test_a_broken_init_is_flagged_at_step_one(run_config, capsys):
    broken = replace(run_config, model=replace(run_config.model, init_std=2.0))
    losses = train(with_train(broken, steps=1))
    out = capsys.readouterr().out
    assert f"step-1 loss {losses[0]:.4f}" in out and f"{math.log(61):.4f}" in out


def test_the_beacon_is_open_while_the_run_is_built_and_gone_however_the_run_ends(
    run_config, tmp_path, monkeypatch
):
    """A hang while the model is built or a checkpoint loaded has a beacon to read (phase
    startup, step 0); a run that fails there leaves no beacon file behind."""
    from goodput import beacon
    from goodput.errors import GoodputError
    from goodput.ranks import BEACON_DIR_VAR
    from goodput.train import loop

    folder = tmp_path / "beacons"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(BEACON_DIR_VAR, str(folder))
    seen = []

    def build_run_that_fails(cfg, runtime, faults=None):
        seen.append(beacon.read_beacon(beacon.beacon_path(folder, runtime.rank)))
        raise GoodputError("checkpoint", "a load that fails", "none: a test")

    monkeypatch.setattr(loop, "build_run", build_run_that_fails)
    with pytest.raises(GoodputError, match="a load that fails"):
        train(run_config)
    (state,) = seen
    assert (state.phase, state.step, state.rank, state.world_size) == ("startup", 0, 0, 1)
    assert sorted(folder.iterdir()) == []  # beacon and stack file removed
