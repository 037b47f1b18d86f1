"""The smoke gate in CI: the demo config, on the data the demo builds from the embedded corpus,
reproduces its committed baseline (configs/baselines/tiny-cpu.smoke.json): bit for bit on the
baseline's CPU model, within the gate's stated tolerance on another. It fails
after a dependency upgrade that changes the numbers; refreshing the baseline is then a
deliberate commit (docs/diagnose.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from goodput.demo import TRAIN_CONFIG, build_shards
from goodput.testing.jobs import REPO, outside_any_job
from goodput.train.device import device_name

BASELINE = REPO / "configs" / "baselines" / "tiny-cpu.smoke.json"


@pytest.mark.timeout(900)  # demo data ~20 s, 50 steps ~40 s on the 2-core CI machine
def test_the_demo_config_reproduces_its_committed_baseline(tmp_path):
    file_list = build_shards(tmp_path)  # the demo's own data step: a fresh build, as in CI
    num_steps = len(json.loads(BASELINE.read_text())["steps"])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "goodput",
            "diagnose",
            "smoke",
            TRAIN_CONFIG,
            f"data.file_list={file_list}",
            f"data.cache={tmp_path / 'cache'}",
            "--baseline",
            BASELINE,
        ],
        capture_output=True,
        text=True,
        # The baseline was recorded with ATen's AVX2 kernels, so that any x86-64 machine with
        # AVX2 reproduces it, not only one with the AVX-512 of the machine it was recorded on.
        env=outside_any_job(ATEN_CPU_CAPABILITY="avx2"),
        timeout=840,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    # Bit for bit on the CPU model the baseline was recorded on; MKL's kernels differ on others.
    recorded_on = json.loads(BASELINE.read_text())["environment"]["device_name"]
    exact = "bit for bit" if device_name(torch.device("cpu")) == recorded_on else "within 0.1%"
    assert result.stdout.splitlines()[-1].startswith(
        f"smoke: OK: {num_steps} steps match {BASELINE} (loss and grad_norm {exact}"
    )
