"""Sharded initialisation: every rank fills only its shard, and the values are the layout's
no matter which — bit for bit the values one process draws for the whole model.

Blocks are made small here (``BLOCK_ELEMENTS`` = 96) so that the tiny model's parameters span
many blocks, rows are cut when a row is bigger than a block, and shards start and end inside
blocks — the cases a real model's 64 Ki-element blocks meet at scale.
"""

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

import goodput.train.init
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL, tiny_run_config
from goodput.train.build import build_model
from goodput.train.config.model import ModelConfig, MoEConfig
from goodput.train.config.run import RunConfig, plan_batches
from goodput.train.device import process_peak_bytes, reset_process_peak
from goodput.train.init import fill_region, normal_blocks
from goodput.train.model import Transformer
from goodput.train.parallel.mesh import build_mesh
from goodput.train.parallel.pipeline import Pipeline

SMALL_BLOCK = 96
DEFAULT_BLOCK = goodput.train.init.BLOCK_ELEMENTS
SEED = 1234
WORLD_SIZE = 4
MOE = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16)
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp_shard=4": dict(dp_shard=4),
    "dp_shard=2,tp=2": dict(dp_shard=2, tp=2),
    "dp_replicate=2,dp_shard=2": dict(dp_replicate=2, dp_shard=2),
    "pp=2,dp_shard=2": dict(pp=2, dp_shard=2),
    "pp=4,uneven": dict(pp=4, pp_layers_per_stage=(2, 1, 0, 1)),
    "tp=2,pp=2,pure-bf16": dict(tp=2, pp=2, precision="pure-bf16"),
    "ep=2,dp_shard=4,moe": dict(ep=2),
    "ep=4,dp_shard=4,moe": dict(ep=4),
}


def layout_config(base: RunConfig, name: str, **parallel: Any) -> RunConfig:
    model = replace(
        base.model,
        vocab_size=64,  # tp = 2 divides it
        num_layers=4,
        tie_embeddings="pp" in parallel,  # a tied head on the last stage draws the embedding's
        moe=MOE if name.endswith("moe") else None,
    )
    return replace(base, model=model, parallel=replace(base.parallel, **parallel))


def reference_values(model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole model as one process draws it."""
    model = Transformer(model_cfg)
    model.reset_parameters(SEED)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def built_values(rank: int, world_size: int, cfgs: list[RunConfig]) -> list[dict[str, Any]]:
    """Each layout built for real on this rank: its parameters gathered whole, by name."""
    goodput.train.init.BLOCK_ELEMENTS = SMALL_BLOCK
    device = torch.device("cpu")
    results = []
    for cfg in cfgs:
        mesh = build_mesh(cfg.parallel, device, ranks_per_host=world_size)
        plan = plan_batches(cfg.train, mesh.dp_size)
        built = build_model(cfg, device, mesh, plan, empty=False)
        parts = built.parts if isinstance(built, Pipeline) else [built]
        values = {}
        for part in parts:
            for name, parameter in part.named_parameters():
                whole = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
                clean = name.replace("_checkpoint_wrapped_module.", "")
                values[clean] = whole.detach().float().clone()
        results.append(values)
    return results


def test_every_layout_draws_the_values_one_process_draws(tmp_path, monkeypatch):
    monkeypatch.setattr(goodput.train.init, "BLOCK_ELEMENTS", SMALL_BLOCK)
    base = tiny_run_config(tmp_path)
    base = replace(base, train=replace(base.train, seed=SEED))
    cfgs = [layout_config(base, name, **parallel) for name, parallel in LAYOUTS.items()]
    by_rank = run_distributed(built_values, WORLD_SIZE, cfgs, timeout_s=600)
    for index, (name, cfg) in enumerate(zip(LAYOUTS, cfgs, strict=True)):
        expected = reference_values(cfg.model)
        if cfg.parallel.precision == "pure-bf16":
            expected = {k: v.to(torch.bfloat16).float() for k, v in expected.items()}
        got: dict[str, torch.Tensor] = {}
        for values in by_rank:
            got.update(values[index])
        if cfg.model.tie_embeddings:  # a whole model holds it once, as the embedding
            got.pop("output.weight", None)
        assert got.keys() == expected.keys(), name
        for key, value in expected.items():
            assert torch.equal(got[key], value), f"{name}: {key}"
        if cfg.model.tie_embeddings:  # the last stage's own head equals the first's embedding
            heads = [v[index]["output.weight"] for v in by_rank if "output.weight" in v[index]]
            assert heads and all(torch.equal(h, expected["embedding.weight"]) for h in heads)


def test_the_distributions_are_the_models():
    cfg = replace(TINY_MODEL, dim=256, ffn_dim=512, num_layers=4)
    model = Transformer(cfg)
    depth_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    block = model.blocks["0"]
    assert torch.equal(block.attention_norm.weight, torch.ones(cfg.dim))
    assert block.mlp.w1.weight.std().item() == pytest.approx(cfg.init_std, rel=0.02)
    assert block.mlp.w2.weight.std().item() == pytest.approx(depth_std, rel=0.02)
    assert block.attention.wo.weight.std().item() == pytest.approx(depth_std, rel=0.02)
    assert abs(block.mlp.w1.weight.mean().item()) < 0.05 * cfg.init_std


def test_a_model_built_alone_follows_torchs_seed():
    torch.manual_seed(0)
    first = Transformer(TINY_MODEL).embedding.weight.clone()
    torch.manual_seed(0)
    again = Transformer(TINY_MODEL).embedding.weight
    torch.manual_seed(1)
    other = Transformer(TINY_MODEL).embedding.weight
    assert torch.equal(first, again) and not torch.equal(first, other)


@st.composite
def regions(draw: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    starts = tuple(draw(st.integers(0, size - 1)) for size in shape)
    sizes = tuple(draw(st.integers(1, size - at)) for size, at in zip(shape, starts, strict=True))
    return shape, starts, sizes


@given(regions(), st.integers(1, 40))
def test_any_region_gets_the_whole_tensors_values(region, block_elements):
    shape, starts, sizes = region
    goodput.train.init.BLOCK_ELEMENTS = block_elements
    try:
        draw = normal_blocks(SEED, "w", 1.0, torch.empty(0))
        whole = torch.empty(shape)
        fill_region(whole, shape, (0,) * len(shape), draw)
        part = torch.empty(sizes)
        fill_region(part, shape, starts, draw)
    finally:
        goodput.train.init.BLOCK_ELEMENTS = DEFAULT_BLOCK
    expected = whole[tuple(slice(a, a + n) for a, n in zip(starts, sizes, strict=True))]
    assert torch.equal(part, expected)


def peak_growth_of_a_sharded_build(cfg: RunConfig, world_size: int, queue: Any) -> None:
    """In a fresh process: rank 0 of ``world_size`` under torch's fake process group builds
    ``cfg``'s model; the growth of its peak resident memory and its shard's bytes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    device = torch.device("cpu")
    mesh = build_mesh(cfg.parallel, device, ranks_per_host=world_size)
    plan = plan_batches(cfg.train, mesh.dp_size)
    reset_process_peak()
    before = process_peak_bytes()
    built = build_model(cfg, device, mesh, plan, empty=False)
    after = process_peak_bytes()
    queue.put((after - before, sum(4 * p.to_local().numel() for p in built.parameters())))


def test_start_up_memory_follows_the_shard_not_the_model(tmp_path):
    """A 0.6 GB (fp32) model on 16 fake ranks: rank 0's peak grows by its 1/16 shard plus the
    working set, far below the whole model that a build-then-cut start allocated."""
    world_size = 16
    base = tiny_run_config(tmp_path)
    cfg = replace(
        base,
        model=ModelConfig(
            vocab_size=32000, dim=1024, num_layers=8, num_heads=16, num_kv_heads=4, ffn_dim=4096
        ),
        train=replace(
            base.train, tokens_per_step=world_size * base.train.seq_len, micro_batch_size=1
        ),
        parallel=replace(base.parallel, dp_shard=world_size),
    )
    with torch.device("meta"):
        whole_bytes = 4 * sum(p.numel() for p in Transformer(cfg.model).parameters())
    context = mp.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=peak_growth_of_a_sharded_build, args=(cfg, world_size, queue))
    child.start()
    child.join(timeout=300)
    child.kill()
    assert child.exitcode == 0, "the sharded build failed: its traceback is above"
    growth, shard_bytes = queue.get(timeout=5)
    assert shard_bytes <= whole_bytes / world_size * 1.01
    # The shard, one 256 KiB block and the allocator's slack: under a sixth of the whole model.
    assert growth < shard_bytes + 64 * 2**20 < whole_bytes / 6, (growth, shard_bytes, whole_bytes)
