"""docs/launch.md's in-process recovery example, run as written in a fresh folder holding the
shipped configs and the demo's data, with the venv's goodput on PATH and one rank really
SIGKILLed after step 6 (a ``goodput chaos`` fault plan handed to the ranks as chaos hands it):
the launch exits 0, the dead rank's place is taken by the warm spare, the three others keep
their processes, and the attempts log records the recovery."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from goodput.launch.history import read_attempts
from goodput.ranks import FAULTS_VAR
from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO, outside_any_job
from tests.chaos.test_chaos_in_process import generations

SECTION = re.compile(r"^## In-process recovery[^\n]*\n(.*?)(?=^## |\Z)", re.S | re.M)


@pytest.mark.timeout(600)
def test_the_in_process_example_runs_as_written_and_survives_a_kill(tmp_path, demo_data):
    match = SECTION.search((REPO / "docs" / "launch.md").read_text())
    assert match is not None
    (line,) = command_lines(match[1], ("sh",))
    assert "--in-process --spares-warm 1" in line
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    shutil.copytree(demo_data, tmp_path / "demo")
    plan = tmp_path / "faults.json"
    plan.write_text(json.dumps({
        "fired_dir": str(tmp_path / "fired"),
        "faults": [{"id": 0, "kind": "kill", "step": 6, "rank": 2}],
    }))  # fmt: skip
    bin_dir = str(Path(sys.executable).parent)
    env = outside_any_job(PATH=f"{bin_dir}:{outside_any_job()['PATH']}", **{FAULTS_VAR: str(plan)})
    result = subprocess.run(
        ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, f"{line}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert (tmp_path / "fired" / "0.json").is_file()  # the kill fired
    records = read_attempts(tmp_path / "launch-local" / "attempts.jsonl")
    assert [record.class_ for record in records] == ["error", "success"]
    recovery = records[1].recovery
    assert recovery is not None and recovery.fallback is None and recovery.rank == 2
    pids = generations(result.stdout)
    assert all(pids[1][rank] == pids[0][rank] for rank in (0, 1, 3)) and pids[1][2] != pids[0][2]
    assert "[rank0] step=20 " in result.stdout
