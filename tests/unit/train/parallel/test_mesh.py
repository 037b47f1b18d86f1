"""The parallel layout: degrees filled in and checked against the world size, one-line errors
that suggest a split that works, and HSDP (replicas of sharded groups) training like one
process."""

import re
import shlex
from dataclasses import replace
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
import torch
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

from goodput.config import load_config
from goodput.errors import GoodputError
from goodput.testing.dist import run_distributed
from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO
from goodput.testing.tiny import TINY_MODEL, rank_micro_batches, uneven_global_batch
from goodput.train.config.parallel import (
    SCHEDULE_PLACEMENT,
    ParallelConfig,
    check_tp_within_hosts,
    pipeline_microbatches,
    rank_stages,
    resolve_degrees,
)
from goodput.train.config.run import RunConfig, check_world
from goodput.train.model import Transformer
from goodput.train.parallel.mesh import build_mesh
from goodput.train.parallel.parallelize import parallelize
from goodput.train.step import StepSettings, train_step

CONFIGS = Path(__file__).parents[4] / "configs"


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


MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.ep=2"], "ep = 2 needs a mixture-of-experts model"),
        ([*MOE, "parallel.ep=8"], "ep = 8 does not divide model.moe.num_experts = 4"),
        (
            [*MOE, "parallel.ep=2", "parallel.data_parallel=replicate", "parallel.precision=fp32"],
            "ep = 2 needs data_parallel = 'fsdp'",
        ),
        (["parallel.cp=128"], "cp = 128 splits each sequence into 256 chunks, more than"),
        (["parallel.cp=3", "parallel.tp=2"], "tp = 2 does not divide the [42, 43] tokens"),
        (
            [*MOE, "parallel.cp=3", "train.seq_len=130", "train.tokens_per_step=4160"],
            "cp = 3 with a mixture-of-experts model needs train.seq_len = 130 to split into 6 "
            "equal chunks",
        ),
    ],
)
def test_context_and_expert_layouts_that_cannot_work_are_refused_in_one_line(overrides, message):
    with pytest.raises(GoodputError) as error:
        load_config(RunConfig, CONFIGS / "tiny-cpu.toml", overrides)
    assert message in error.value.render() and "\n" not in error.value.render()
    assert error.value.code == 2


def docs_layout_lines() -> list[str]:
    """docs/parallel.md's ``goodput launch --nproc N -- goodput train configs/tiny-cpu.toml``
    lines: one per layout."""
    lines = command_lines((REPO / "docs" / "parallel.md").read_text(), ("sh",))
    return [line for line in lines if "--nproc" in line and "configs/tiny-cpu.toml" in line]


@pytest.mark.parametrize("line", docs_layout_lines())
def test_each_layout_docs_parallel_shows_is_taken_on_its_ranks(line):
    """Up to where the ranks are needed: each layout is run on the same tiny model by
    tests/unit/train/test_layout_invariance.py."""
    words = shlex.split(line)
    nproc = int(words[words.index("--nproc") + 1])
    overrides = words[words.index("configs/tiny-cpu.toml") + 1 :]
    cfg = load_config(RunConfig, CONFIGS / "tiny-cpu.toml", overrides)
    check_world(cfg, nproc, nproc)


@pytest.mark.parametrize("schedule", SCHEDULE_PLACEMENT)
def test_each_rank_builds_the_stages_torchs_schedule_places_on_it(schedule):
    """torch's V schedules set the stages' placement themselves: ``build_pipeline`` must have
    built each rank's stages where they look for them."""
    assert schedule in get_args(get_type_hints(ParallelConfig)["pp_schedule"])
    style = "v" if SCHEDULE_PLACEMENT[schedule] == "v" else "loop"
    for pp in (2, 3, 4):
        cfg = ParallelConfig(precision="fp32", pp=pp, pp_schedule=schedule)
        placed = generate_rank_to_stage_mapping(pp, cfg.num_stages, style=style)
        stages = {r: rank_stages(schedule, pp, cfg.stages_per_rank, r) for r in range(pp)}
        assert stages == placed


def test_expert_parallelism_borrows_ranks_of_dp_shard():
    degrees = resolve_degrees(ParallelConfig(ep=2), 4)
    assert (degrees.dp_shard, degrees.ep, degrees.expert_shard, degrees.product()) == (4, 2, 2, 4)
    assert (
        degrees.describe()
        == "pp 1 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 1 (ep 2 within dp_shard)"
    )
    with pytest.raises(GoodputError, match="ep = 4 does not divide dp_shard = 2") as error:
        resolve_degrees(ParallelConfig(ep=4, dp_replicate=2), 4)
    assert "ep = 2" in error.value.render()  # a divisor that works


def test_replicate_shards_nothing():
    with pytest.raises(GoodputError, match="data_parallel = 'replicate' shards nothing"):
        ParallelConfig(data_parallel="replicate", precision="fp32", dp_shard=2)


def hsdp_step(rank, world_size, dp_replicate):
    cfg = ParallelConfig(precision="fp32", dp_replicate=dp_replicate)
    mesh = build_mesh(cfg, torch.device("cpu"), ranks_per_host=world_size)
    torch.manual_seed(0)
    model = parallelize(Transformer(TINY_MODEL), cfg, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = rank_micro_batches(*uneven_global_batch(), mesh.dp_rank, mesh.dp_size, 2)
    result = train_step(
        model, optimizer, micro, StepSettings(max_grad_norm=None, token_group=mesh.token_group)
    )
    weights = model.output.weight.full_tensor()[:3, :3].detach().clone()
    return mesh.dp_rank, mesh.dp_size, result.loss, result.grad_norm, weights


def test_replicas_of_sharded_groups_train_like_one_process():
    torch.manual_seed(0)
    model = Transformer(TINY_MODEL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = train_step(
        model, optimizer, [uneven_global_batch()], StepSettings(max_grad_norm=None)
    )
    weights = model.output.weight[:3, :3].detach()
    results = run_distributed(hsdp_step, 4, 2, timeout_s=300)  # 2 replicas x 2 shards
    assert [(dp_rank, dp_size) for dp_rank, dp_size, *_ in results] == [(r, 4) for r in range(4)]
    for _, _, loss, grad_norm, rank_weights in results:
        assert loss == pytest.approx(reference.loss, rel=1e-5)
        assert grad_norm == pytest.approx(reference.grad_norm, rel=1e-4)
        assert torch.allclose(rank_weights, weights, atol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.tp=3"], "tp = 3 does not divide model.num_heads = 4"),
        (["parallel.tp=4"], "tp = 4 does not divide model.num_kv_heads = 2"),
        (["parallel.tp=2", "train.seq_len=127", "train.tokens_per_step=4064"], "train.seq_len"),
        (["parallel.pp=8"], "8 pipeline stages for 4 layers"),
        (["parallel.pp=2", "parallel.pp_layers_per_stage=[1, 2]"], "sums to 3 layers"),
        (["parallel.pp=2", "parallel.pp_layers_per_stage=[4]"], "lists 1 stages, but pp 2"),
        (
            [
                "parallel.pp=2",
                "parallel.pp_schedule=interleaved_1f1b",
                "parallel.pp_stages_per_rank=1",
            ],
            ">= 2",
        ),
        (
            ["parallel.pp=2", "parallel.pp_stages_per_rank=2"],
            "needs pp_schedule 'interleaved_1f1b'",
        ),
        (
            ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=3"],
            "places exactly 2 stages on each rank",
        ),
        (
            [
                "parallel.pp=2",
                "parallel.pp_schedule=interleaved_zb",
                "parallel.pp_stages_per_rank=1",
            ],
            ">= 2",
        ),
        # What torch's split backward cannot run, refused with its reason.
        (
            ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.compile=true"],
            "cannot run a compiled block's backward in two parts (pytorch/pytorch#161904)",
        ),
        (
            [
                "parallel.pp=2",
                "parallel.pp_schedule=interleaved_zb",
                'parallel.activation_checkpointing="op"',
            ],
            "selective recompute takes one backward through a block",
        ),
        # Without a pipeline the pipeline's keys do nothing: refused as such, naming the key.
        (["parallel.pp_stages_per_rank=2"], "'parallel.pp_stages_per_rank' is set but has no"),
    ],
)
def test_a_layout_that_cannot_split_the_model_is_refused_by_name(overrides, message):
    with pytest.raises(GoodputError) as error:
        load_config(RunConfig, CONFIGS / "tiny-cpu.toml", overrides)
    assert message in error.value.render() and "\n" not in error.value.render()
    assert error.value.code == 2


@pytest.mark.parametrize(
    "overrides", [["parallel.tp=2"], ["parallel.cp=2"], [*MOE, "parallel.ep=2"], ["parallel.pp=2"]]
)
def test_compile_is_taken_in_every_layout(overrides):
    # Each compiled layout trains as the eager one does: test_compile_layouts.
    cfg = load_config(RunConfig, CONFIGS / "tiny-cpu.toml", [*overrides, "parallel.compile=true"])
    assert cfg.parallel.compile


@pytest.mark.parametrize(
    "overrides",
    [
        [*MOE, "parallel.tp=2", "parallel.ep=2"],
        [*MOE, "parallel.pp=2", "parallel.cp=2", "parallel.tp=2"],
        ["parallel.cp=2", "parallel.pp=2"],
    ],
)
def test_every_split_composes_with_experts_and_pipeline_stages(overrides):
    # Each trains as one process does: test_layout_invariance.
    cfg = load_config(RunConfig, CONFIGS / "tiny-cpu.toml", overrides)
    assert cfg.parallel.pp * cfg.parallel.cp * cfg.parallel.tp * cfg.parallel.ep >= 4


@pytest.mark.parametrize(
    ("tp", "world_size", "ranks_per_host", "refused"),
    [
        (4, 8, 4, False),  # each TP group is one host
        (2, 24, 12, False),  # six groups per Aurora-like host
        (8, 16, 4, True),  # a group spans two hosts
        (4, 24, 6, True),  # groups straddle host boundaries
        (8, 8, 8, False),  # one host: nothing to cross
        (3, 3, 1, True),  # one rank per host: every TP collective on the network
    ],
)
def test_a_tensor_parallel_group_split_across_hosts_is_refused(
    tp, world_size, ranks_per_host, refused
):
    if not refused:
        check_tp_within_hosts(tp, world_size, ranks_per_host)
        return
    with pytest.raises(GoodputError, match=f"tp = {tp} does not divide the {ranks_per_host}"):
        check_tp_within_hosts(tp, world_size, ranks_per_host)


def mesh_groups(rank, world_size, overrides):
    mesh = build_mesh(ParallelConfig(precision="fp32", **overrides), torch.device("cpu"), 4)
    tp_ranks = mesh.tp_mesh.mesh.flatten().tolist()
    pp_ranks = torch.distributed.get_process_group_ranks(mesh.pp_group)
    return tp_ranks, pp_ranks, mesh.dp_rank, mesh.dp_size


def test_tensor_parallel_groups_are_consecutive_ranks_and_pipelines_span_them():
    results = run_distributed(mesh_groups, 4, {"tp": 2, "pp": 2}, timeout_s=120)
    assert [r[0] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[1] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # One data-parallel share for all: TP and PP ranks read the same batch.
    assert {(r[2], r[3]) for r in results} == {(0, 1)}


def test_the_layout_line_names_the_degrees_in_mesh_order():
    degrees = resolve_degrees(ParallelConfig(precision="fp32", tp=2, pp=2), 8)
    assert degrees.describe() == "pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2"


def test_pipeline_microbatches_that_do_not_divide_the_pipelines_batch_are_refused():
    cfg = ParallelConfig(precision="fp32", pp=2, pp_microbatches=3)
    with pytest.raises(GoodputError) as error:
        pipeline_microbatches(cfg, local_batch_size=8, default=4)
    assert "pp_microbatches = 3 does not divide the 8 samples" in error.value.render()
    assert error.value.code == 2
    assert pipeline_microbatches(replace(cfg, pp_microbatches=None), 8, default=4) == 4
