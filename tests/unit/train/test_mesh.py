"""The parallel layout: degrees filled in and checked against the world size, one-line errors
that suggest a split that works, and HSDP (replicas of sharded groups) training like one
process."""

import re
from pathlib import Path

import pytest
import torch

from goodput.config import load_config
from goodput.errors import GoodputError
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL, rank_micro_batches, uneven_global_batch
from goodput.train.config import RunConfig
from goodput.train.mesh import build_mesh, resolve_degrees
from goodput.train.model import Transformer
from goodput.train.parallelize import ParallelConfig, parallelize
from goodput.train.step import train_step

CONFIGS = Path(__file__).parents[3] / "configs"


def dp_split(world_size, **degrees):
    resolved = resolve_degrees(ParallelConfig(precision="fp32", **degrees), world_size)
    return resolved.dp_replicate, resolved.dp_shard


def test_the_kind_of_data_parallelism_takes_what_the_world_size_leaves():
    assert dp_split(4) == (1, 4)  # fsdp: every rank shards
    assert dp_split(4, data_parallel="replicate") == (4, 1)
    assert dp_split(4, dp_replicate=2) == (2, 2)  # HSDP: 2 replicas of 2 shards
    assert dp_split(4, dp_replicate=2, dp_shard=2) == (2, 2)
    assert dp_split(1) == (1, 1)


@pytest.mark.parametrize(
    ("world_size", "degrees", "suggested"),
    [
        (4, {"dp_replicate": 2, "dp_shard": 3}, {"dp_replicate": 2, "dp_shard": 2}),
        (3, {"dp_replicate": 2}, {"dp_replicate": 1, "dp_shard": 3}),
        (1, {"dp_shard": 2}, {"dp_replicate": 1, "dp_shard": 1}),
        (4, {"data_parallel": "replicate", "dp_replicate": 3}, {"dp_replicate": 4}),
    ],
)
def test_a_product_that_is_not_the_world_size_suggests_a_split_that_is(
    world_size, degrees, suggested
):
    with pytest.raises(GoodputError) as error:
        dp_split(world_size, **degrees)
    line = error.value.render()
    assert "\n" not in line and error.value.code == 2
    assert f"ranks, but the world has {world_size}" in line
    hint = {key: int(value) for key, value in re.findall(r"(dp_\w+) = (\d+)", line)}
    assert suggested.items() <= hint.items()
    assert dp_split(world_size, **{**degrees, **hint})  # the suggestion works


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("parallel.tp=2", "tp = 2: tensor parallelism is not supported yet; set tp = 1"),
        ("parallel.pp=4", "pp = 4: pipeline parallelism is not supported yet"),
        ("parallel.cp=2", "cp = 2: context parallelism is not supported yet"),
        ("parallel.ep=8", "ep = 8: expert parallelism is not supported yet"),
    ],
)
def test_other_parallelisms_are_refused_as_not_yet_in_one_line(override, message):
    with pytest.raises(GoodputError) as error:
        load_config(RunConfig, CONFIGS / "tiny-cpu.toml", [override])
    assert message in error.value.render() and "\n" not in error.value.render()
    assert error.value.code == 2


def test_replicate_shards_nothing():
    with pytest.raises(GoodputError, match="data_parallel = 'replicate' shards nothing"):
        ParallelConfig(data_parallel="replicate", precision="fp32", dp_shard=2)


def hsdp_step(rank, world_size, dp_replicate):
    cfg = ParallelConfig(precision="fp32", dp_replicate=dp_replicate)
    mesh = build_mesh(cfg, torch.device("cpu"))
    torch.manual_seed(0)
    model = parallelize(Transformer(TINY_MODEL), cfg, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = rank_micro_batches(*uneven_global_batch(), mesh.dp_rank, mesh.dp_size, 2)
    result = train_step(model, optimizer, micro, max_grad_norm=None, dp_group=mesh.dp_group)
    weights = model.output.weight.full_tensor()[:3, :3].detach().clone()
    return mesh.dp_rank, mesh.dp_size, result.loss, result.grad_norm, weights


def test_replicas_of_sharded_groups_train_like_one_process():
    torch.manual_seed(0)
    model = Transformer(TINY_MODEL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = train_step(model, optimizer, [uneven_global_batch()], max_grad_norm=None)
    weights = model.output.weight[:3, :3].detach()
    results = run_distributed(hsdp_step, 4, 2, timeout_s=300)  # 2 replicas x 2 shards
    assert [(dp_rank, dp_size) for dp_rank, dp_size, *_ in results] == [(r, 4) for r in range(4)]
    for _, _, loss, grad_norm, rank_weights in results:
        assert loss == pytest.approx(reference.loss, rel=1e-5)
        assert grad_norm == pytest.approx(reference.grad_norm, rel=1e-4)
        assert torch.allclose(rank_weights, weights, atol=1e-6)
