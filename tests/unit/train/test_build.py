"""The model built empty for a checkpoint load: allocated on its device (sharded where FSDP
shards it), a tied head still tied, rotary buffers computed, and given the fresh values when no
load comes."""

from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor

from goodput.testing.dist import run_distributed
from goodput.testing.tiny import tiny_run_config
from goodput.train.build import build_model
from goodput.train.config.run import plan_batches
from goodput.train.init import initialize_model
from goodput.train.parallel.mesh import build_mesh


def full_state(model):
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).clone()
        for name, value in model.state_dict().items()
    }


def build_empty_then_fresh(rank, world_size, cfg):
    device = torch.device("cpu")
    mesh = build_mesh(cfg.parallel, device, ranks_per_host=world_size)
    plan = plan_batches(cfg.train, mesh.dp_size)
    fresh = build_model(cfg, device, mesh, plan, empty=False)
    empty = build_model(cfg, device, mesh, plan, empty=True)
    allocated = all(p.device == device for p in [*empty.parameters(), *empty.buffers()])
    tied = (empty.output.weight is empty.embedding.weight) == cfg.model.tie_embeddings
    same_buffers = tied and torch.equal(
        empty.blocks["0"].attention.inv_freq, fresh.blocks["0"].attention.inv_freq
    )
    initialize_model([empty], cfg.model, cfg.train.seed)
    fresh_state, filled_state = full_state(fresh), full_state(empty)
    same = fresh_state.keys() == filled_state.keys() and all(
        torch.equal(fresh_state[name], filled_state[name]) for name in fresh_state
    )
    return allocated, same_buffers, same


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_an_empty_build_is_allocated_and_takes_the_fresh_values(tmp_path, tie_embeddings):
    cfg = tiny_run_config(tmp_path)  # fp32: FSDP-sharded on 2 ranks, whole on 1
    cfg = replace(cfg, model=replace(cfg.model, tie_embeddings=tie_embeddings))
    for world_size in (1, 2):
        assert run_distributed(build_empty_then_fresh, world_size, cfg) == [(True, True, True)] * (
            world_size
        )
