"""``goodput plan layout --verify`` (``goodput.plan.verify``): the trainer's own build under a
fake process group of a whole machine, against the planner's estimate; one rank materialised.

Children are spawned (torch's import is most of their time), so the cases share as few as they
can: one end-to-end verification, one survey child for every rank of small worlds."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from goodput.config import to_toml
from goodput.errors import ExitCode, GoodputError
from goodput.plan.layout import Layout
from goodput.plan.memory import GIB, state_bytes_per_device
from goodput.plan.verify import (
    PLACEHOLDER_FILE_LIST,
    RankState,
    fake_store,
    moment_buffers,
    most_state,
    run_config,
    run_in_child,
    survey,
    verify_layout,
)
from goodput.train.config.model import ModelConfig, MoEConfig
from goodput.train.config.optim import OptimConfig
from goodput.train.config.parallel import ParallelConfig
from goodput.train.model import Transformer
from goodput.train.optim.optimizers import Optimizers

# Rows that 4 FSDP ranks do not divide (wk's and wv's 50 per TP rank of 2), so the fullest
# rank holds more than the average; 5 layers over 2 stages.
UNEVEN = ModelConfig(
    vocab_size=1000, dim=200, num_layers=5, num_heads=4, num_kv_heads=2, ffn_dim=480
)


def model_table(model: ModelConfig) -> str:
    return "[model]\n" + to_toml(model)


def model_only_config(tmp_path: Path, model: ModelConfig) -> Path:
    path = tmp_path / "model.toml"
    path.write_text(model_table(model))
    return path


def layout_of(parallel: ParallelConfig) -> Layout:
    return Layout(dp_shard=parallel.dp_shard or 1, tp=parallel.tp, pp=parallel.pp, ep=parallel.ep)


def test_the_fake_store_imports():
    # torch keeps it in an internal module of its tests: this is where a torch upgrade breaks.
    assert type(fake_store()).__name__ == "FakeStore"


def test_one_rank_of_a_machine_verifies_on_this_cpu(tmp_path):
    """A 0.52B model on 64 fake ranks (pp 2 x dp_shard 8 x tp 4), from a config of only
    [model]: the most state any rank holds is the planner's estimate, and rank 0 (the first
    stage, with the embedding) is built for real, its peak following its 35 MB shard, not the
    2.1 GB model."""
    model = ModelConfig(
        vocab_size=32000, dim=2000, num_layers=9, num_heads=20, num_kv_heads=4, ffn_dim=5600
    )
    path = model_only_config(tmp_path, model)
    parallel = ParallelConfig(dp_shard=8, tp=4, pp=2)
    estimated = state_bytes_per_device(model, layout_of(parallel), parallel.precision)
    verified = verify_layout(
        path,
        model,
        parallel,
        nhosts=8,
        ppn=8,
        seq_len=256,
        micro_batch_size=1,
        global_batch_size=16,
        rank=None,
        estimated_state_gib=estimated / GIB,
    )
    assert verified.world == 64
    assert [state.rank for state in verified.surveyed] == [0, 32]
    assert verified.most.rank == 0 and verified.agrees
    assert verified.most.state_bytes == pytest.approx(estimated, rel=1e-12)
    done = verified.materialized
    assert done.rank == 0
    # Its parameters' storages (FSDP's padded shards hold at least the local ones) and the
    # rotary tables; nothing of anyone else's shards.
    assert verified.most.parameter_bytes <= done.num_bytes < verified.most.parameter_bytes * 1.01
    with torch.device("meta"):
        whole = 4 * sum(p.numel() for p in Transformer(model).parameters())
    assert done.num_bytes < whole / 32
    assert done.num_bytes <= done.peak_rss_bytes < done.num_bytes + 256 * 2**20 < whole / 4
    assert 0 < done.seconds < 60
    assert verified.to_json() == {
        "state_gib_per_device_built": verified.most.state_bytes / GIB,
        "state_gib_per_device_estimated": estimated / GIB,
        "rank": 0,
        "materialized_gib": done.num_bytes / GIB,
        "init_seconds": done.seconds,
        "peak_rss_gib": done.peak_rss_bytes / GIB,
    }
    text = verified.format_text()
    assert "64 ranks" in text and "agree" in text and "rank 0 materialised" in text


def survey_cases(cases: list[tuple]) -> list[list[RankState]]:
    """In one child: ``survey`` for each case."""
    return [survey(*case) for case in cases]


def test_the_first_rank_of_each_stage_holds_the_most_and_the_estimate_is_it(tmp_path):
    """Every rank of small worlds surveyed: within each pipeline stage no rank holds more
    than the stage's first, whose state is the planner's estimate for that stage, exactly —
    uneven FSDP shards, both precisions' dtypes, and a mixture of experts whose 4 experts
    spread over 8 ranks (each of the first 4 holds a whole one)."""
    path = model_only_config(tmp_path, UNEVEN)
    moe_model = replace(
        UNEVEN, num_layers=2, moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=64)
    )
    layouts = [  # and whether some rank of a stage holds less than its first
        (UNEVEN, ParallelConfig(dp_shard=4, tp=2, pp=2), True),
        (UNEVEN, ParallelConfig(dp_shard=2, tp=2, pp=3, precision="pure-bf16"), False),
        (moe_model, ParallelConfig(dp_shard=8, ep=2), True),
        (moe_model, ParallelConfig(dp_shard=8), True),
    ]
    cases, worlds = [], []
    for model, parallel, _ in layouts:
        world = (parallel.dp_shard or 1) * parallel.tp * parallel.pp
        cfg = run_config(
            path, model, parallel, seq_len=64, micro_batch_size=1, global_batch_size=world
        )
        cases.append((cfg, world, world, list(range(world))))
        worlds.append(world)
    results = run_in_child(survey_cases, (cases,), "survey", timeout_s=600)
    for (model, parallel, uneven), world, states in zip(layouts, worlds, results, strict=True):
        layout = layout_of(parallel)
        per_stage = world // parallel.pp
        for stage in range(parallel.pp):
            own = states[stage * per_stage : (stage + 1) * per_stage]
            assert {s.pp_rank for s in own} == {stage}
            assert most_state(own) == own[0]
            estimated = state_bytes_per_device(model, layout, parallel.precision, stage)
            assert own[0].state_bytes == estimated, (parallel, stage)
        assert (len({s.state_bytes for s in states}) > parallel.pp) == uneven
        assert most_state(states).state_bytes == state_bytes_per_device(
            model, layout, parallel.precision
        )


@pytest.mark.parametrize("kind", ["adamw", "lamb", "sophiag", "muon", "mano"])
def test_moment_buffers_are_each_optimizers_state(kind):
    # The state each optimizer really keeps after a step, against the count from its groups.
    model = Transformer(
        ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48)
    )
    optimizers = Optimizers([model], OptimConfig(kind=kind), lr=1e-3)
    model(torch.randint(0, 64, (2, 16))).float().sum().backward()
    optimizers.step()
    counted = sum(
        moment_buffers(group) * parameter.numel()
        for group in optimizers.param_groups
        for parameter in group["params"]
    )
    kept = sum(
        tensor.numel()
        for optimizer in optimizers.optimizers
        for state in optimizer.state.values()
        for tensor in state.values()
        if torch.is_tensor(tensor) and tensor.ndim > 0  # not the step counters
    )
    assert counted == kept


def test_a_complete_recipe_takes_the_plans_batch_and_layout(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        model_table(UNEVEN)
        + "[train]\nsteps = 5\ntokens_per_step = 512\nseq_len = 64\nmicro_batch_size = 2\n"
        + 'run_dir = "runs/x"\nactivation_checkpointing = true\n'
        + '[optim]\nkind = "muon"\n[parallel]\ntp = 5\n'
    )
    parallel = ParallelConfig(dp_shard=4, tp=2, activation_checkpointing="full")
    cfg = run_config(path, UNEVEN, parallel, seq_len=128, micro_batch_size=1, global_batch_size=8)
    assert (cfg.train.seq_len, cfg.train.micro_batch_size) == (128, 1)
    assert cfg.train.tokens_per_step == 8 * 128 and cfg.train.steps == 5
    assert cfg.parallel == parallel and cfg.optim.kind == "muon"  # the file's tp 5 is not read
    assert cfg.data.file_list == PLACEHOLDER_FILE_LIST


@pytest.mark.parametrize(
    ("parallel", "ppn", "rank", "said"),
    [
        (ParallelConfig(dp_shard=3, tp=2), 4, None, "world"),
        (ParallelConfig(dp_shard=16, tp=3), 4, None, "tp = 3 does not divide"),
        (ParallelConfig(dp_shard=32, tp=2), 1, None, "host"),
        (ParallelConfig(dp_shard=16, tp=2, pp=2), 4, 64, "rank 64 is not in the world of 64"),
        (ParallelConfig(dp_shard=64), 4, None, "does not split"),
    ],
)
def test_a_layout_that_does_not_build_is_one_line_before_any_child(
    tmp_path, parallel, ppn, rank, said
):
    path = model_only_config(tmp_path, UNEVEN)
    start = time.perf_counter()
    with pytest.raises(GoodputError) as error:
        verify_layout(
            path,
            UNEVEN,
            parallel,
            nhosts=64 // ppn,
            ppn=ppn,
            seq_len=64,
            micro_batch_size=1,
            global_batch_size=32,
            rank=rank,
            estimated_state_gib=1.0,
        )
    assert time.perf_counter() - start < 2, "refused without starting a child"
    line = error.value.render()
    assert "\n" not in line and said in line and error.value.code == ExitCode.USAGE
    assert (str(path) in line) != (rank is not None)  # the config, or the --rank option
    assert error.value.fix


@pytest.mark.parametrize("section", ["train", "data"])
def test_a_section_that_is_not_a_table_is_one_line(tmp_path, section):
    path = tmp_path / "bad.toml"
    path.write_text(f"{section} = 3\n" + model_table(UNEVEN))
    with pytest.raises(GoodputError) as error:
        run_config(
            path, UNEVEN, ParallelConfig(), seq_len=64, micro_batch_size=1, global_batch_size=1
        )
    assert error.value.code == ExitCode.USAGE and f"write it as [{section}]" in error.value.render()


def test_a_child_that_dies_or_hangs_is_one_line():
    with pytest.raises(GoodputError, match="exited with status 3 without a result"):
        run_in_child(os._exit, (3,), "cfg.toml on 1 x 8 ranks", timeout_s=60)
    start = time.perf_counter()
    with pytest.raises(GoodputError, match="ran past 1 s"):
        run_in_child(time.sleep, (60,), "cfg.toml on 1 x 8 ranks", timeout_s=1)
    assert time.perf_counter() - start < 30
