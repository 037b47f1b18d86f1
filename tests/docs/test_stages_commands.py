"""docs/data.md's "Stages" example, run as written in a fresh folder holding the demo's data
(built as the demo builds it, ``goodput.demo.build_shards``), with the venv's goodput on PATH:
three stages over the demo corpora, each stage's mixture reported, the anneal's wrap flagged."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO, outside_any_job

SECTION = re.compile(r"^## Stages\n(.*?)(?=^## )", re.S | re.M)


@pytest.mark.timeout(600)  # demo data ~30 s on 2 cores when no other test built it, the blend 1 s
def test_the_stages_example_runs_as_written(tmp_path, demo_data):
    match = SECTION.search((REPO / "docs" / "data.md").read_text())
    assert match is not None
    lines = command_lines(match[1], ("sh",))
    assert [line.split()[:3] for line in lines][-1] == ["goodput", "data", "blend"]
    shutil.copytree(demo_data, tmp_path / "demo")
    bin_dir = str(Path(sys.executable).parent)
    env = outside_any_job(PATH=f"{bin_dir}:{outside_any_job()['PATH']}")
    for line in lines:
        result = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
    report = result.stdout
    for header in (
        "stage 0 from sample 0",
        "stage 1 from sample 2,048",
        "stage 2 from sample 3,072",
    ):
        assert header in report
    assert "WARNING: corpus 'docs' wraps in stage 2" in report
    assert "corpus 'docs' wraps in stage 2" in result.stderr
    result = subprocess.run(
        ["bash", "-c", f"{lines[-1]} --json"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    stages = json.loads(result.stdout)["stages"]
    assert [[row["name"] for row in stage["report"]["corpora"]] for stage in stages] == [
        ["code", "docstrings", "docs"],
        ["code", "docstrings"],
        ["docs", "docstrings"],
    ]
    assert [row["wrapped"] for row in stages[2]["report"]["corpora"]] == [True, False]
