"""A ``slow`` or ``stall`` fault is judged by whether the launcher names its rank, and it names a
rank against its peers: a campaign that could never name one (a single rank; two ranks under a
straggler ratio of 2 or more, which neither of two ranks can reach: the median is their mean)
is refused at start, naming the option and the fix, before its folder is written or a run
starts. ``goodput chaos`` runs as a real process, outside any job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from goodput.config import to_toml
from goodput.errors import ExitCode
from goodput.testing.jobs import REPO, outside_any_job
from goodput.testing.tiny import tiny_run_config


def chaos(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(tiny_run_config(tmp_path)))
    out = tmp_path / "campaign"
    argv = [sys.executable, "-m", "goodput", "chaos", str(config), "--output", str(out), *args]
    done = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, env=outside_any_job(), timeout=120
    )
    return done, out


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--kinds", "slow", "--nproc", "1"],
         "goodput: error: --nproc: slow fault(s) need two ranks or more: the launcher names a "
         "slow or stalled rank against its peers, and 1 rank has none; give --nproc 2 or more, "
         "or leave slow out of --kinds"),
        (["--kinds", "stall", "--nproc", "1", "--faults", "1"],
         "goodput: error: --nproc: stall fault(s) need two ranks or more"),
        (["--kinds", "slow,stall", "--nproc", "1", "--faults", "2"],
         "goodput: error: --nproc: slow and stall fault(s) need two ranks or more"),
        (["--kinds", "slow", "--nproc", "2", "--faults", "1", "watch.straggler_ratio=2"],
         "goodput: error: watch.straggler_ratio: is 2: of 2 ranks no rank is 2x the median "
         "(their mean), so the straggler watch could never name a slow fault's rank; lower "
         "watch.straggler_ratio below 2, give --nproc 3 or more, or leave slow out of --kinds"),
    ],
)  # fmt: skip
def test_a_fault_whose_rank_cannot_be_named_is_refused_before_anything_runs(tmp_path, args, said):
    done, out = chaos(tmp_path, *args)
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert done.stderr.startswith(said) and done.stderr.count("\n") == 1, done.stderr
    assert done.stdout == "" and not out.exists()  # no run started, no folder written


def test_one_rank_still_runs_the_kinds_that_need_no_peer(tmp_path):
    """The control: the same single rank with a kind judged without naming passes these checks
    (refused later only for what the control asks, a kind it cannot place)."""
    done, out = chaos(tmp_path, "--kinds", "kill", "--nproc", "1", "--faults", "40")
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert "need two ranks" not in done.stderr and "faults at distinct steps" in done.stderr
    assert not out.exists()
