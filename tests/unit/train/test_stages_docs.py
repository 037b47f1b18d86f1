"""docs/training.md's "Data-mix stages": its commands, as written, on stand-ins for the demo's
corpora (random tokens under the demo's shard names), train three stages with the LR decaying
from the last one's start and report each stage's mixture; its TOML reads to the stages of its
command line's override."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from goodput import rundir
from goodput.runfiles import read_steps
from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO, outside_any_job
from goodput.testing.stages import load_tiny_cpu, write_domain_shards

SECTION = re.compile(r"^## Data-mix stages\n(.*?)(?=^## )", re.S | re.M)
TOML = re.compile(r"```toml\n(.*?)```", re.S)


def section() -> str:
    (text,) = SECTION.findall((REPO / "docs" / "training.md").read_text())
    return text


def test_the_documented_commands_train_three_stages_and_report_them(tmp_path):
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    write_domain_shards(tmp_path / "demo" / "shards", vocab_size=4096, num_docs=2000)
    env = outside_any_job(PATH=f"{Path(sys.executable).parent}:{outside_any_job()['PATH']}")
    outputs = []
    for line in command_lines(section(), ("sh",)):
        result = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=400,
        )  # fmt: skip
        assert result.returncode == 0, line + result.stdout[-3000:] + result.stderr[-3000:]
        outputs.append(result.stdout)
    lines = list(read_steps(tmp_path / "demo" / "stages" / rundir.METRICS))
    assert [line.raw["stage"] for line in lines] == [0] * 15 + [1] * 9 + [2] * 6
    assert [line.raw["tokens"] for line in lines] == [4096 * s for s in range(1, 31)]
    lrs = [line.raw["lr"] for line in lines]
    assert lrs[19:25] == [lrs[19]] * 6  # flat through step 25, the last stage's first
    assert all(later < earlier for earlier, later in zip(lrs[24:], lrs[25:], strict=False))
    assert "data-mix stages" in outputs[-1]  # goodput report's table of them


def test_the_documented_toml_is_the_stages_of_the_command_line(tmp_path):
    (toml,) = TOML.findall(section())
    from_file = load_tiny_cpu(tmp_path, f"[data]\n{toml}")
    (command,) = [line for line in command_lines(section(), ("sh",)) if "data.stages=" in line]
    override = re.search(r"'(data\.stages=.*?)'", command)
    assert override is not None
    from_command = load_tiny_cpu(tmp_path, '[data]\nfile_list = "x"', (override[1],))
    assert from_file.stage_steps() == from_command.stage_steps() == (0, 15, 24)
    assert from_file.data.file_lists() == from_command.data.file_lists()
