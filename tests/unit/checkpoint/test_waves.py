"""At most ``max_concurrent_writers`` ranks write at the same moment: a real DCP save on 4 gloo
ranks, each rank's write stretched and timed, so overlaps would show."""

import time

import torch
from torch.distributed.checkpoint import FileSystemWriter

from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.save import Checkpointer
from goodput.checkpoint.state import CheckpointContents
from goodput.rundir import list_checkpoints
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL
from goodput.train.config.parallel import ParallelConfig
from goodput.train.model import Transformer
from goodput.train.parallel.parallelize import parallelize

WRITE_SECONDS = 0.3


def save_once(rank, world_size, root, max_writers):
    write_data = FileSystemWriter.write_data
    intervals = []

    def timed_write(self, plan, planner):
        start = time.time()
        time.sleep(WRITE_SECONDS)  # a slow filesystem: long enough for overlaps to be seen
        result = write_data(self, plan, planner)
        intervals.append((start, time.time()))
        return result

    FileSystemWriter.write_data = timed_write
    torch.manual_seed(0)
    model = parallelize(Transformer(TINY_MODEL), ParallelConfig(precision="fp32"))
    optimizer = torch.optim.AdamW(model.parameters())
    cfg = CheckpointConfig(max_concurrent_writers=max_writers)
    contents = CheckpointContents(parts=[model], optimizers=[optimizer])
    checkpointer = Checkpointer(cfg, root, torch.device("cpu"), contents)
    checkpointer.save(1, blocking=True)
    checkpointer.close()
    return intervals[0]


def most_at_once(intervals):
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


def test_writers_take_turns(tmp_path):
    one_at_a_time = run_distributed(save_once, 4, tmp_path / "one", 1)
    assert most_at_once(one_at_a_time) == 1
    two_at_a_time = run_distributed(save_once, 4, tmp_path / "two", 2)
    assert most_at_once(two_at_a_time) == 2
    for root in (tmp_path / "one", tmp_path / "two"):
        assert [(c.step, c.complete) for c in list_checkpoints(root)] == [(1, True)]
