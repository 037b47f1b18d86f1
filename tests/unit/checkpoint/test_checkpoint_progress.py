"""A real save and load on 2 gloo ranks report their bytes as they go: rank 0 alone, in plain
lines on stderr (the trainer's mode), with the plain-line interval at 0 so every write shows."""

import io
import re
import sys

import torch

import goodput.progress
from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.load import load_checkpoint
from goodput.checkpoint.save import Checkpointer
from goodput.checkpoint.state import CheckpointContents
from goodput.io import read_json
from goodput.rundir import TRAIN_STATE, step_dir
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL
from goodput.train.config.parallel import ParallelConfig
from goodput.train.model import Transformer
from goodput.train.parallel.parallelize import parallelize

AMOUNT = re.compile(r": ([\d.]+)% ([\d.]+ k?B) of ([\d.]+ k?B)")


def save_and_load(rank, world_size, root):
    goodput.progress.PLAIN_INTERVAL_S = 0.0
    sys.stderr = captured = io.StringIO()
    torch.manual_seed(0)
    model = parallelize(Transformer(TINY_MODEL), ParallelConfig(precision="fp32"))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()  # the optimizer's state exists, so it is saved and loaded too
    contents = CheckpointContents(parts=[model], optimizers=[optimizer])
    checkpointer = Checkpointer(CheckpointConfig(), root, torch.device("cpu"), contents)
    checkpointer.save(1, blocking=True)
    checkpointer.close()
    fresh = parallelize(Transformer(TINY_MODEL), ParallelConfig(precision="fp32"))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    train_state = read_json(step_dir(root, 1) / TRAIN_STATE)
    fresh_contents = CheckpointContents(parts=[fresh], optimizers=[fresh_optimizer])
    load_checkpoint(step_dir(root, 1), fresh_contents, train_state, torch.device("cpu"))
    return captured.getvalue()


def test_save_and_load_report_their_bytes_on_rank_0(tmp_path):
    rank0, rank1 = run_distributed(save_and_load, 2, tmp_path / "run")
    assert rank1 == ""
    directory = step_dir(tmp_path / "run", 1)
    for kind in ("save", "load"):
        lines = [line for line in rank0.splitlines() if line.startswith(f"checkpoint {kind} ")]
        assert len(lines) > 3, rank0  # one line per write or tensor, then the closing line
        assert all(line.startswith(f"checkpoint {kind} {directory}: ") for line in lines)
        percents = [float(AMOUNT.search(line).group(1)) for line in lines]
        assert percents == sorted(percents) and percents[0] < 100.0 == percents[-1]
        assert re.search(r" in 0:00:\d\d \([\d.]+ [kM]?B/s\)$", lines[-1]), lines[-1]
    # A load reads exactly its tensors' bytes; a save writes torch's framing on top of them.
    load_done, load_total = AMOUNT.search(lines[-1]).group(2, 3)
    assert load_done == load_total
