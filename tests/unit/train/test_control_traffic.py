"""What goodput itself sends each step, recorded on real gloo ranks: every ``torch.distributed``
call made from goodput's own code (not from torch's FSDP or DCP inside it), with the bytes of its
tensors, by step. A training run of 2 ranks and one of 4, snapshots and saves on, send the same
calls with the same bytes on every step after the first: nothing goodput adds grows with W."""

from __future__ import annotations

import collections
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

import goodput
from goodput import beacon
from goodput.testing.dist import run_distributed
from goodput.train.config.run import WatchConfig
from goodput.train.loop import train

GOODPUT = str(Path(goodput.__file__).parent)
TESTING = str(Path(goodput.__file__).parent / "testing")
# Every collective and point-to-point call of torch.distributed a caller can make by name.
CALLS = [
    name
    for name in (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "batch_isend_irecv",
        "monitored_barrier",
    )
    if hasattr(dist, name)
]


def tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(item) for item in value)
    return 0


def record_goodput_calls(rank, world_size, cfg):
    """Train ``cfg`` with every torch.distributed call goodput makes recorded: by step, a
    count of (call, caller, bytes, group size)."""
    by_step: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for name in CALLS:
        original = getattr(dist, name)

        def recorded(*args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code
            where = caller.co_filename
            if where.startswith(GOODPUT) and not where.startswith(TESTING):
                group = kwargs.get("group")
                size = dist.get_world_size(group) if group is not None else world_size
                at = f"{Path(where).name}:{caller.co_name}"
                sent = tensor_bytes(args[0] if args else kwargs.get("tensor"))
                by_step[beacon.current()._step][(_name, at, sent, size == world_size)] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, recorded)
    train(cfg)
    return {step: dict(calls) for step, calls in by_step.items()}


def test_goodput_sends_the_same_bytes_each_step_at_2_and_4_ranks(run_config):
    cfg = replace(
        run_config,
        train=replace(run_config.train, steps=5),
        checkpoint=replace(run_config.checkpoint, interval_steps=3, memory_interval_steps=2),
        watch=WatchConfig(straggler_steps=2),  # windows judged at steps 3 and 5
    )
    runs = {}
    for world in (2, 4):
        run_dir = Path(cfg.train.run_dir).with_name(f"run{world}")
        sized = replace(cfg, train=replace(cfg.train, run_dir=str(run_dir)))
        runs[world] = run_distributed(record_goodput_calls, world, sized)[0]  # rank 0's
    two, four = runs[2], runs[4]
    assert sorted(two) == sorted(four)
    steady = [step for step in sorted(two) if step >= 2]
    assert steady == [2, 3, 4, 5]
    for step in steady:
        assert two[step] == four[step], step
    sites = {at for step in steady for (_, at, _, _) in two[step]}
    assert "wire.py:reduce" in sites  # the vote is among what was recorded
    total = [sum(sent * n for (_, _, sent, _), n in two[step].items()) for step in steady]
    assert max(total) < 64 * 1024  # a few kilobytes a step, whatever W
