"""Hang forensics inside a real Slurm allocation, on the single-node Slurm of this machine (CI
starts it with ``.ci/start-slurm``; elsewhere this skips, and under GOODPUT_REQUIRE_ALL=1 the skip
is a failure).

Two gloo ranks run as one ``srun`` step; rank 1 stalls in its data phase at step 3 while rank 0
waits in the all-reduce. The hung step still holds the node, so the forensics reach it through
``srun --overlap`` (a plain ``srun`` would wait for the step to end, and the host would count as
silent): the collect command reads both beacons there, and the stalled rank is named with its
host, step, phase and frame.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from goodput.launch.history import read_attempts
from goodput.testing.jobs import outside_any_job, slurm_node

TIMEOUT_S = 90

WORKER = """
    import os, time
    print("starting", flush=True)  # the watchdog counts silence; imports come next
    import torch, torch.distributed as dist
    from goodput.beacon import open_beacon
    print("imported", flush=True)
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    print("joined", flush=True)
    beacon = open_beacon(os.environ, rank=rank, world_size=world, local_rank=rank, host="node")

    def stall_in_data():
        while True:
            time.sleep(0.05)

    for step in range(1, 50):
        beacon.step(step)
        beacon.phase("data")
        if rank == 1 and step == 3:
            stall_in_data()
        beacon.phase("forward")
        with beacon.collective("step.tokens"):
            dist.all_reduce(torch.ones(1))
        if rank == 0:
            print(f"step={step}", flush=True)
"""


@pytest.mark.skipif(
    slurm_node() is None,
    reason="needs a running Slurm with a usable node (apt: slurm-wlm munge; .ci/start-slurm)",
)
def test_a_stalled_rank_is_named_through_srun_overlap(tmp_path):
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    run_dir = tmp_path / "run"
    salloc = ["salloc", "--nodes", "1", "--ntasks", "2", "--overcommit", "--time", "3"]
    launch = [sys.executable, "-m", "goodput", "launch", "--ppn", "2", "--timeout", "6"]
    launch += ["--grace", "1", "--run-dir", str(run_dir), "--"]
    result = subprocess.run(
        [*salloc, "--job-name", "goodput-test", *launch, sys.executable, "worker.py"],
        cwd=tmp_path,
        env=outside_any_job(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 124, result.stderr
    node = slurm_node()
    (record,) = read_attempts(run_dir / "attempts.jsonl")
    suspect = record.evidence[0]
    assert (suspect.source, suspect.host, suspect.rank, suspect.step) == (
        "hang-suspect",
        node,
        1,
        3,
    )
    assert f"hang suspect: rank 1 on {node} (pid " in suspect.said
    assert "not in a collective at step 3, phase data, while 1 rank(s) wait in step.tokens" in (
        suspect.said
    )
    assert "stack: worker.py:14 stall_in_data <- worker.py:20 <module>" in suspect.said
    assert "launch: forensics: 2 beacon(s) read on 1 host(s) in " in result.stderr
