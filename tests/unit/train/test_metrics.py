"""MFU's denominator: the datasheet table for accelerators, a real matmul probe on CPU."""

import pytest
import torch

from goodput.train.build import fresh_loss_warning
from goodput.train.metrics import datasheet_peak_flops, peak_flops, step_line


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
