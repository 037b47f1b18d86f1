"""Save and resume through the real loop: bit-exact resume (into a model built
empty), resume at another DP size, the choice of checkpoint, refusals, and saves that fail on
one rank or on a full disk."""

import json
import os
import resource
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.load import find_checkpoint, load_tensors
from goodput.config import from_table, to_toml
from goodput.errors import GoodputError
from goodput.rundir import LATEST, checkpoints_dir, list_checkpoints, step_dir
from goodput.testing.dist import run_distributed
from goodput.train.convert.checkpoints import from_torch, to_torch
from goodput.train.loop import train


def with_checkpoints(cfg, output, **changes):
    checkpoint = replace(cfg.checkpoint, interval_steps=4, **changes)
    return replace(cfg, train=replace(cfg.train, run_dir=str(output)), checkpoint=checkpoint)


def everything_saved(directory, tmp_path):
    """Model, optimizer state and all of a checkpoint as plain tensors (weights_only load)."""
    out = tmp_path / f"{directory.parent.parent.name}-{directory.name}.pt"
    dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=True)


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_bitwise_equal(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_resume_is_bit_exact(run_config, tmp_path):
    straight = with_checkpoints(run_config, tmp_path / "straight")
    losses = train(straight)
    saved = list_checkpoints(checkpoints_dir(straight.train.run_dir))
    assert [(c.step, c.complete) for c in saved] == [(4, True), (8, True)]
    assert (checkpoints_dir(straight.train.run_dir) / LATEST).read_text().strip() == "step-00000008"

    resumed_cfg = with_checkpoints(run_config, tmp_path / "resumed", resume=str(saved[0].path))
    resumed = train(resumed_cfg)
    assert resumed == losses[4:]  # exactly, step for step
    final = step_dir(checkpoints_dir(resumed_cfg.train.run_dir), 8)
    assert_bitwise_equal(
        everything_saved(saved[1].path, tmp_path), everything_saved(final, tmp_path)
    )
    state = json.loads((final / "train_state.json").read_text())
    assert state["step"] == 8 and state["loader"]["consumed_samples"] == 64


def train_on_rank(rank, world_size, cfg):
    return train(cfg)


def test_a_model_built_empty_for_a_refused_checkpoint_starts_as_a_fresh_one(run_config, tmp_path):
    cfg = with_checkpoints(run_config, tmp_path / "run")
    losses = train(cfg)
    metrics = Path(cfg.train.run_dir) / "metrics.jsonl"
    metrics.unlink()
    for saved in list_checkpoints(checkpoints_dir(cfg.train.run_dir)):
        damaged = next(saved.path.glob("*.distcp"))  # refused by its checksum, after the build
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
    assert train(cfg) == losses  # auto refused both: a fresh start, bit for bit
    assert metrics.read_text().count("\n") == 8


@pytest.mark.parametrize(("saved_at", "resumed_at"), [(1, 2), (2, 1)])
def test_resume_at_another_dp_size_continues_the_run(run_config, tmp_path, saved_at, resumed_at):
    def run(cfg, ranks):
        return train(cfg) if ranks == 1 else run_distributed(train_on_rank, ranks, cfg)[0]

    first = with_checkpoints(run_config, tmp_path / "first")
    losses = run(first, saved_at)
    step_4 = step_dir(checkpoints_dir(first.train.run_dir), 4)
    resumed = run(with_checkpoints(run_config, tmp_path / "second", resume=str(step_4)), resumed_at)
    assert resumed == pytest.approx(losses[4:], rel=1e-5)


def test_auto_resume_skips_incomplete_and_damaged_checkpoints_by_name(run_config, tmp_path, capsys):
    longer = replace(run_config, train=replace(run_config.train, steps=12))
    cfg = with_checkpoints(longer, tmp_path / "run")
    train(cfg)
    root = checkpoints_dir(cfg.train.run_dir)
    (step_dir(root, 12) / ".complete").unlink()
    damaged = next(step_dir(root, 8).glob("*.distcp"))
    damaged.write_bytes(damaged.read_bytes()[:100])
    capsys.readouterr()
    assert find_checkpoint(root, "auto") == step_dir(root, 4)
    out = capsys.readouterr().out
    assert f"skipping checkpoint {step_dir(root, 12)}: incomplete" in out
    assert f"skipping checkpoint {step_dir(root, 8)}: damaged ({damaged.name}" in out
    assert find_checkpoint(root, "never") is None
    with pytest.raises(GoodputError, match="incomplete"):
        find_checkpoint(root, str(step_dir(root, 12)))


def test_a_rerun_resumes_where_the_run_stopped(run_config, tmp_path, capsys):
    cfg = with_checkpoints(run_config, tmp_path / "run")
    train(cfg)
    (step_dir(checkpoints_dir(cfg.train.run_dir), 8) / ".complete").unlink()  # as if killed
    hotter = replace(cfg, schedule=replace(cfg.schedule, lr=0.02))
    assert len(train(hotter)) == 4  # auto: from step 4
    out = capsys.readouterr().out
    assert "resume: config differs from the checkpoint's: schedule.lr: 0.01 -> 0.02" in out


def test_resume_refuses_other_data_and_another_model(run_config, tmp_path):
    first = with_checkpoints(run_config, tmp_path / "first")
    train(first)
    step_4 = str(step_dir(checkpoints_dir(first.train.run_dir), 4))
    other_data = replace(run_config, data=replace(run_config.data, seed=99))
    with pytest.raises(GoodputError, match=r"data fingerprint differs .*seed changed"):
        train(with_checkpoints(other_data, tmp_path / "a", resume=step_4))
    allowed = with_checkpoints(other_data, tmp_path / "b", resume=step_4, allow_data_change=True)
    assert len(train(allowed)) == 4
    wider = replace(run_config, model=replace(run_config.model, ffn_dim=128))
    with pytest.raises(GoodputError, match=r"model differs .*model.ffn_dim: 64 -> 128"):
        train(with_checkpoints(wider, tmp_path / "c", resume=step_4))


def fail_writes_on_rank_one(rank, world_size, cfg):
    if rank == 1:  # a real write error, on one rank only: files may not grow past 4 KiB
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    return train(cfg)


def test_a_save_failing_on_one_rank_is_reported_and_training_goes_on(run_config, tmp_path, capfd):
    cfg = with_checkpoints(run_config, tmp_path / "run", folder=str(tmp_path / "ckpt"))
    results = run_distributed(fail_writes_on_rank_one, 2, cfg)
    assert all(len(losses) == 8 for losses in results)
    out = capfd.readouterr().out
    assert out.count("FAILED on rank(s) 1: file too large") == 2  # steps 4 and 8, rank 0 reports
    assert list_checkpoints(tmp_path / "ckpt") == []  # nothing half-written left behind
    log = (Path(cfg.train.run_dir) / "metrics.jsonl").read_text()
    assert log.count("\n") == 8


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "small"
    mount.mkdir()
    # One ~500 kB checkpoint of the tiny model fits, a second one does not.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=800k", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_keeps_the_previous_checkpoint(run_config, tmp_path, small_tmpfs, capsys):
    cfg = with_checkpoints(run_config, tmp_path / "run", folder=str(small_tmpfs), keep_last=2)
    train(cfg)
    out = capsys.readouterr().out
    assert "FAILED on rank(s) 0: disk full" in out
    assert [(c.step, c.complete) for c in list_checkpoints(small_tmpfs)] == [(4, True)]
    assert (small_tmpfs / LATEST).read_text().strip() == "step-00000004"


def test_checkpoint_config_is_checked():
    with pytest.raises(GoodputError, match=r"'keep_last' = 0 is not in \[1,"):
        from_table(CheckpointConfig, {"keep_last": 0}, "run.toml")


def test_training_starts_from_a_model_only_checkpoint(run_config, tmp_path, capsys):
    first = with_checkpoints(run_config, tmp_path / "first")
    losses = train(first)
    weights, config = tmp_path / "weights.pt", tmp_path / "model.toml"
    to_torch(step_dir(checkpoints_dir(first.train.run_dir), 8), weights)
    config.write_text(to_toml(run_config))
    imported = from_torch(weights, config, tmp_path / "imported")
    capsys.readouterr()
    again = train(with_checkpoints(run_config, tmp_path / "second", resume=str(imported)))
    out = capsys.readouterr().out
    assert len(again) == 8 and again[0] < losses[0] - 0.5  # trained weights, fresh optimizer
    assert f"resume: from {imported} (step 0)" in out and "warning: step-1" not in out


def test_saves_by_wall_time(run_config, tmp_path):
    cfg = replace(
        run_config,
        train=replace(run_config.train, run_dir=str(tmp_path / "run")),
        checkpoint=replace(run_config.checkpoint, interval_minutes=1e-6, keep_last=8),
    )
    train(cfg)
    # Every step outlasts 60 microseconds, so every step is due.
    saved = list_checkpoints(checkpoints_dir(tmp_path / "run"))
    assert [c.step for c in saved] == list(range(1, 9))


def test_a_pickled_value_in_a_checkpoint_is_refused_not_loaded(tmp_path):
    # DCP stores non-tensors as pickles and would unpickle them with weights_only=False.
    dcp.save({"model": {"weight": [1, 2, 3]}}, checkpoint_id=tmp_path, no_dist=True)
    with pytest.raises(GoodputError, match="model.weight: the checkpoint holds a pickled object"):
        load_tensors({"model": {"weight": torch.zeros(3)}}, tmp_path, no_dist=True)


def test_a_refused_resume_leaves_the_run_directory_as_it_was(run_config, tmp_path):
    run_dir = tmp_path / "run"
    cfg = with_checkpoints(run_config, run_dir)
    train(cfg)
    before = {p: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    other_data = replace(cfg, data=replace(cfg.data, seed=99))
    with pytest.raises(GoodputError, match="data fingerprint differs"):
        train(other_data)  # auto: finds step 8 of the other data
    assert {p: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
