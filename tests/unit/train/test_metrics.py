"""MFU's denominator: the datasheet table for accelerators, a real matmul probe on CPU; the
sinks: TensorBoard carries every numeric key of metrics.jsonl, Weights & Biases (offline) the
same, read back from its own run file; wandb asked for but not installed is one line."""

import json
import struct
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from goodput.errors import GoodputError
from goodput.train.build import fresh_loss_warning
from goodput.train.config.metrics import MetricsConfig
from goodput.train.loop import train
from goodput.train.metrics import Metrics, datasheet_peak_flops, peak_flops, step_line
from goodput.train.step import StepResult


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("AMD Instinct MI250X", 191.5),
        ("AMD Instinct MI300X", 1307.4),
        ("Intel(R) Data Center GPU Max 1550", 419.4),
    ],
)
def test_datasheet_peaks(name, tflops):
    assert datasheet_peak_flops(name) == pytest.approx(tflops * 1e12)


def test_an_unknown_accelerator_gets_no_peak_rather_than_a_guess():
    assert datasheet_peak_flops("NVIDIA GeForce RTX 4090") is None


def test_cpu_peak_is_measured_and_a_configured_peak_wins():
    measured, source = peak_flops(torch.device("cpu"), torch.float32, None)
    assert measured > 1e8 and "matmul probe" in source
    assert peak_flops(torch.device("cpu"), torch.float32, 2.5) == (2.5e12, "train.peak_tflops")


def test_step_line_starts_with_the_step_and_says_when_mfu_is_unknown():
    record = dict(
        step=7,
        loss=2.5,
        grad_norm=0.5,
        lr=1e-3,
        tokens_per_s=1000.0,
        tokens_per_s_per_device=500.0,
        mfu=None,
        peak_memory_gib=1.0,
        step_time_s=0.1,
    )
    line = step_line(record)
    assert line.startswith("step=7 loss=2.5000 ") and "mfu=n/a" in line


def test_fresh_loss_warning_only_far_from_ln_vocab():
    assert fresh_loss_warning(8.3, 4096) is None
    warning = fresh_loss_warning(12.0, 4096)
    assert warning is not None and "12.0000" in warning and "8.3178" in warning


# --- sinks ------------------------------------------------------------------------------------


def write_two_steps(run_dir: Path, **options) -> list[dict]:
    metrics = Metrics(
        run_dir,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        tokens_per_step=128,
        flops_per_token=1000,
        peak_flops_per_device=None,  # mfu null: left out of the sinks
        **options,
    )
    records = [
        metrics.step(
            1,
            StepResult(2.5, 0.5, 128),
            1e-3,
            0.1,
            0,
            {"gns": 3.0, "loss_z": None},
            stage=0,
            tokens=128,
        ),
        metrics.step(
            2, StepResult(2.0, float("inf"), 128, skipped=True), 1e-3, 0.1, 1, stage=0, tokens=256
        ),
    ]
    metrics.close()
    return records


def test_tensorboard_carries_every_numeric_key_of_metrics_jsonl(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_two_steps(tmp_path, tensorboard=True)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for line in lines:
        numeric = {
            key: value
            for key, value in line.items()
            if key not in ("step", "time") and isinstance(value, int | float)
        }
        assert numeric.keys() >= {"loss", "lr", "tokens_per_s", "skipped_steps"}
        for key, value in numeric.items():
            (logged,) = [e for e in events.Scalars(f"train/{key}") if e.step == line["step"]]
            assert logged.value == pytest.approx(float(value), rel=1e-6), key
    scalars = set(events.Tags()["scalars"])
    assert "train/mfu" not in scalars and "train/loss_z" not in scalars  # null: left out
    assert "train/grad_norm" in scalars  # step 1's; step 2's inf is null in both


WANDB_BLOCK = 32 * 1024  # the .wandb file: a LevelDB-style log of 32 KiB blocks
WANDB_HEADER = 7  # ":W&B", a 2-byte magic and a version byte; each record's header is 7 too


def wandb_history(run_file: Path) -> dict[int, dict]:
    """``{step: {key: value}}`` of an offline run's ``.wandb`` file, read with wandb's own
    record type: the log's records (crc32, length, kind; kind 2-4 split one across blocks)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    history: dict[int, dict] = {}
    position, payload = WANDB_HEADER, b""
    while position + WANDB_HEADER <= len(data):
        left = WANDB_BLOCK - position % WANDB_BLOCK
        if left < WANDB_HEADER:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, position)
        start = position + WANDB_HEADER
        payload += data[start : start + length]
        position = start + length
        if kind in (1, 4):  # a full record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            if record.WhichOneof("record_type") == "history":
                # A key with "/" is stored split into nested_key.
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                history[record.history.step.num] = items
    return history


def test_wandb_offline_run_holds_the_losses_at_their_steps(run_config, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # whatever the config said: no network here
    cfg = replace(run_config, metrics=MetricsConfig(wandb=True))  # offline is the default
    losses = train(cfg)
    run_dir = Path(cfg.train.run_dir)
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (run_file,) = offline.glob("*.wandb")
    history = wandb_history(run_file)
    assert sorted(history) == list(range(1, 9))
    assert [history[step]["train/loss"] for step in range(1, 9)] == pytest.approx(losses)
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for line in jsonl:  # the keys TensorBoard gets (numbers, not the slowest host's name)
        numeric = {
            k for k, v in line.items() if k not in ("step", "time") and isinstance(v, int | float)
        }
        logged = {key for key in history[line["step"]] if not key.startswith("_")}
        assert logged == {f"train/{key}" for key in numeric}


def test_wandb_asked_for_but_missing_is_one_line_before_anything_is_written(
    run_config, monkeypatch
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails
    cfg = replace(run_config, metrics=MetricsConfig(wandb=True))
    with pytest.raises(GoodputError) as raised:
        train(cfg)
    assert str(raised.value) == (
        "[metrics] wandb: is true but wandb is not installed; pip install wandb, or set "
        "[metrics] wandb = false"
    )
    assert not Path(cfg.train.run_dir).exists() and not Path(cfg.data.cache).exists()


def test_the_metrics_table_reads_from_toml_and_checks_the_mode():
    from goodput.config import from_table

    read = from_table(MetricsConfig, {"wandb": True, "wandb_dir": "/scratch/wb"}, "run.toml")
    assert read == MetricsConfig(wandb=True, wandb_mode="offline", wandb_dir="/scratch/wb")
    with pytest.raises(GoodputError, match="wandb_mode") as raised:
        from_table(MetricsConfig, {"wandb_mode": "cloud"}, "run.toml", "metrics.")
    assert "offline" in str(raised.value)
