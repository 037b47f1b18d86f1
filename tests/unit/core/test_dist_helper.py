import os
import time

import pytest
import torch
import torch.distributed as dist

from goodput.testing.dist import run_distributed


def all_reduce_rank(rank, world_size, offset):
    tensor = torch.tensor([float(rank + offset)])
    dist.all_reduce(tensor)
    return tensor.item(), dist.get_world_size()


def fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def hang(rank, world_size):
    time.sleep(600)


def die(rank, world_size):
    if rank == 1:
        os._exit(3)
    time.sleep(600)


def test_results_come_back_in_rank_order():
    assert run_distributed(all_reduce_rank, 3, 10) == [(33.0, 3)] * 3


def test_rank_failure_is_reraised_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1 failed(.|\n)*boom on rank one"):
        run_distributed(fail_on_rank_one, 2)


def test_hang_hits_the_hard_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\]"):
        run_distributed(hang, 2, timeout_s=8)
    assert time.monotonic() - start < 30


def test_dead_rank_is_reported():
    with pytest.raises(RuntimeError, match="rank1 died"):
        run_distributed(die, 2, timeout_s=60)


def return_tensors(rank, world_size):
    return [torch.full((8, 8), float(rank)) for _ in range(200)]


def test_tensors_survive_the_rank_exiting_first():
    # Regression: tensors used to travel as shared-memory fds that vanished with the rank.
    for _ in range(3):
        results = run_distributed(return_tensors, 2)
        assert [float(r[199][7, 7]) for r in results] == [0.0, 1.0]
