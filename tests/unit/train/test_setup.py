"""setup_torch under a faked MPI launcher: two real processes, a real gloo process group."""

import os
import resource
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

import goodput
from goodput.errors import GoodputError
from goodput.train.device import BACKENDS, backend_for, detect_device_type

RANK_SCRIPT = """
import torch, torch.distributed as dist, goodput
runtime = goodput.setup_torch(seed=3)
rank = runtime.rank
assert runtime.world_size == 2 and runtime.device == torch.device("cpu")
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(rank, dist.get_world_size(), dist.get_backend(), value.item(), torch.rand(1).item())
dist.destroy_process_group()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_from_pmi_variables():
    port = str(free_port())
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "SLURM_", "PBS_", "MASTER_"))
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **base,
                "PMI_RANK": str(r),
                "PMI_SIZE": "2",
                "MASTER_PORT": port,
                "GOODPUT_DEVICE": "cpu",
            },
        )
        for r in range(2)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    lines = sorted(out.split() for out, _ in outputs)
    assert [line[:4] for line in lines] == [["0", "2", "gloo", "3.0"], ["1", "2", "gloo", "3.0"]]
    assert lines[0][4] == lines[1][4]  # same seed on every rank: identical model init


def test_single_process_needs_no_port(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("GOODPUT_DEVICE", "cpu")
    try:
        runtime = goodput.setup_torch()
        assert (runtime.rank, runtime.world_size, runtime.device.type) == (0, 1, "cpu")
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


def test_device_override_and_backends():
    assert detect_device_type({"GOODPUT_DEVICE": "cpu"}) == "cpu"
    assert detect_device_type({}) in BACKENDS
    assert [backend_for(d) for d in ("cuda", "xpu", "mps", "cpu")] == [
        "nccl",
        "xccl",
        "gloo",
        "gloo",
    ]
    with pytest.raises(GoodputError, match="unknown device type 'tpu'"):
        detect_device_type({"GOODPUT_DEVICE": "tpu"})


def test_the_soft_limit_of_open_files_rises_to_the_hard_limit():
    """Rank 0 holds a socket for every rank twice over (the store, DCP's coordinator): a child
    started with a soft limit of 256 under a hard one of 4,096 runs with 4,096."""
    script = (
        "import resource\n"
        "from goodput.train.setup import open_files_to_hard_limit\n"
        "print(open_files_to_hard_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    hard = min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])

    def lowered():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, preexec_fn=lowered
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(hard), str(hard)]
