"""docs/diagnose.md's smoke commands, run as written in a fresh folder that holds the shipped
configs and the demo's data (built as the demo builds it, ``goodput.demo.build_shards``), with
the venv's goodput on PATH:

- the usage example: a one-process record, the check against it, and the same config on 2
  ranks with tensor parallelism against it (the layouts' tolerance), whose line is the one the
  page shows;
- the refresh section's checks of the committed baselines (``configs/baselines/``), under its
  ``export ATEN_CPU_CAPABILITY=avx2``: the smoke gate in CI. They hold bit for bit on the CPU
  model they were recorded on and within the gate's stated tolerance on another; a change that
  moves the numbers fails them, and refreshing them is then a deliberate commit. The section's
  ``--record`` lines would rewrite the committed files: each records the file a check line
  names (asserted here), and recording is run by the usage example.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO, outside_any_job
from goodput.train.device import device_name

PAGE = REPO / "docs" / "diagnose.md"
SECTION = r"^## {}\n(.*?)(?=^## )"


def section_lines(title: str) -> list[str]:
    match = re.search(SECTION.format(re.escape(title)), PAGE.read_text(), re.S | re.M)
    assert match is not None, title
    return command_lines(match[1], ("sh",))


@pytest.fixture(scope="module")
def folder(tmp_path_factory, demo_data):
    """A fresh folder with the shipped configs and the demo's data where the demo config
    reads it (``demo/file_list.txt``, ``demo/cache``)."""
    folder = tmp_path_factory.mktemp("smoke-docs")
    shutil.copytree(REPO / "configs", folder / "configs")
    shutil.copytree(demo_data, folder / "demo")
    return folder


def run_lines(folder: Path, lines: list[str]) -> list[str]:
    """Each line in bash after the block's ``export`` lines; the last line each printed."""
    exports = [line for line in lines if line.startswith("export ")]
    bin_dir = str(Path(sys.executable).parent)
    env = outside_any_job(PATH=f"{bin_dir}:{outside_any_job()['PATH']}")
    last_lines = []
    for line in lines:
        if line in exports:
            continue
        result = subprocess.run(
            ["bash", "-c", "; ".join([*exports, line])],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=840,
        )
        assert result.returncode == 0, f"{line}\n{result.stdout[-3000:]}\n{result.stderr}"
        last_lines.append(result.stdout.splitlines()[-1])
    return last_lines


@pytest.mark.timeout(900)  # demo data ~20 s, three runs of 5 steps ~45 s on 2 cores
def test_the_usage_example_runs_as_written(folder):
    lines = section_lines("Smoke: the bit-exact gate")
    assert [shlex.split(line)[:3] for line in lines] == [["goodput", "diagnose", "smoke"]] * 3
    recorded, checked, other_layout = run_lines(folder, lines)
    assert recorded == "smoke: recorded 5 steps of configs/tiny-cpu.toml on 1 process in smoke.json"
    assert checked.startswith("smoke: OK: 5 steps match smoke.json (loss and grad_norm bit for")
    # The line the page shows for another layout is the one it prints.
    assert f"```\n{other_layout}\n```" in PAGE.read_text()


@pytest.mark.timeout(900)  # 50 steps of one process ~40 s, 20 steps of 2 ranks ~30 s
def test_the_committed_baselines_hold(folder):
    lines = section_lines("The demo config's baselines, checked in CI")
    exports = [line for line in lines if line.startswith("export ")]
    checks = [line for line in lines if "--baseline configs/baselines/" in line]
    records = [line for line in lines if "--record configs/baselines/" in line]
    baselines = sorted(path.name for path in (REPO / "configs" / "baselines").iterdir())
    assert sorted(Path(shlex.split(line)[-1]).name for line in checks) == baselines
    for record, check in zip(records, checks, strict=True):
        assert shlex.split(record)[-2:] == ["--record", shlex.split(check)[-1]]
    for check, last_line in zip(checks, run_lines(folder, [*exports, *checks]), strict=True):
        baseline = shlex.split(check)[-1]
        recorded = json.loads((REPO / baseline).read_text())
        # Bit for bit on the CPU model a baseline was recorded on; MKL's kernels differ on others.
        on_its_cpu = device_name(torch.device("cpu")) == recorded["environment"]["device_name"]
        exact = "bit for bit" if on_its_cpu else "within 0.1%"
        assert last_line.startswith(
            f"smoke: OK: {len(recorded['steps'])} steps match {baseline} (loss and grad_norm "
            f"{exact}"
        ), last_line
