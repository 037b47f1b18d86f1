"""The memory model's terms against what the real modules hold: parameter counts against
``flops.model_size`` and real modules, the activation count against the bytes autograd saves
for one block, the checkpointed block's against its inputs, and the worst-stage shortcut
against every stage."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from goodput.plan.layout import Layout, balanced_layer_split
from goodput.plan.memory import (
    Parameters,
    Workload,
    _stage,
    estimate,
    layer_activation_bytes,
    state_bytes_per_device,
)
from goodput.train.config.model import ModelConfig, MoEConfig
from goodput.train.config.parallel import ParallelConfig, even_layer_split
from goodput.train.config.precision import PRECISIONS
from goodput.train.flops import model_size
from goodput.train.model import Block, Transformer

DENSE = ModelConfig(
    vocab_size=1000, dim=256, num_layers=3, num_heads=8, num_kv_heads=4, ffn_dim=768
)
MOE = replace(DENSE, moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=384, shared_expert=True))


def saved_for_backward(module: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd saves in ``module``'s forward, its own parameters
    and buffers left out (they are the state, not activations)."""
    own = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(*inputs)
    return sum(seen.values())


def test_the_precisions_are_the_trainers():
    import typing

    from goodput.commands import plan

    bytes_per_parameter = {name: p.bytes_per_parameter for name, p in PRECISIONS.items()}
    assert bytes_per_parameter == {"fp32-master": 16, "pure-bf16": 8, "fp32": 16}
    dtype_bytes = {name: (p.compute_bytes, p.reduce_bytes) for name, p in PRECISIONS.items()}
    assert dtype_bytes == {"fp32-master": (2, 4), "pure-bf16": (2, 2), "fp32": (4, 4)}
    trainer = typing.get_args(typing.get_type_hints(ParallelConfig)["precision"])
    assert tuple(PRECISIONS) == plan.PRECISIONS == trainer


@pytest.mark.parametrize("model", [DENSE, MOE, replace(DENSE, tie_embeddings=True)])
def test_the_parameter_split_adds_up_to_the_model(model):
    params = Parameters.of(model)
    block = params.block_split + params.block_whole + params.block_experts
    head = 0 if params.tied else params.head
    total = model.num_layers * block + params.embedding + head + params.final_norm
    assert total == model_size(model).total
    real = Transformer(model)
    assert total == sum(p.numel() for p in real.parameters())
    experts = sum(p.numel() for n, p in real.named_parameters() if ".experts." in n)
    assert experts == model.num_layers * params.block_experts


@pytest.mark.parametrize(
    ("model", "dtype"),
    [(DENSE, torch.float32), (DENSE, torch.bfloat16), (MOE, torch.bfloat16), (MOE, torch.float32)],
    ids=["dense-fp32", "dense-bf16", "moe-bf16", "moe-fp32"],
)
def test_a_blocks_activations_are_what_autograd_saves(model, dtype):
    tokens = 256
    block = Block(model).to(dtype)
    x = torch.randn(1, tokens, model.dim, dtype=dtype, requires_grad=True)
    measured = saved_for_backward(block, x, torch.arange(tokens))
    compute_bytes = 4 if dtype == torch.float32 else 2
    estimated = tokens * layer_activation_bytes(model, compute_bytes, tp=1)
    # Dense: exact. MoE: within 0.1% (per-expert count vectors, a few bytes a layer).
    assert measured == pytest.approx(estimated, rel=1e-3)


def test_a_checkpointed_block_keeps_only_its_input():
    tokens = 256
    block = checkpoint_wrapper(Block(DENSE))
    x = torch.randn(1, tokens, DENSE.dim, requires_grad=True)
    measured = saved_for_backward(block, x, torch.arange(tokens))
    # The block input, fp32, plus the positions (int64, one tensor that every layer shares).
    assert measured == tokens * DENSE.dim * 4 + tokens * 8


def test_tp_splits_all_but_the_gathered_matmul_inputs_and_the_rotary_tables():
    one, four = (layer_activation_bytes(DENSE, 2, tp) for tp in (1, 4))
    whole = 2 * 2 * DENSE.dim + 4 * DENSE.head_dim
    assert four == pytest.approx((one - whole) / 4 + whole)


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 7])
@pytest.mark.parametrize("checkpointing", ["none", "full", "op"])
@pytest.mark.parametrize("split", ["even", "balanced"])
def test_the_worst_stage_is_found_among_three(pp, checkpointing, split):
    model = replace(DENSE, num_layers=11, tie_embeddings=True)
    work = Workload(seq_len=64, micro_batch_size=1, global_batch_samples=16)
    layers = balanced_layer_split(11, pp) if split == "balanced" else None
    layout = Layout(
        pp=pp, dp_shard=2, activation_checkpointing=checkpointing, pp_layers_per_stage=layers
    )
    every = [_stage(model, layout, work, 2**30, stage).total for stage in range(pp)]
    assert estimate(model, layout, work, 2**30).total == max(every)


def test_the_balanced_split_gives_the_first_and_last_stages_fewer_layers():
    # Llama 3 405B: 126 layers on 16 stages, one layer fewer on the first and the last (Dubey et
    # al. 2024, section 3.3.2).
    assert balanced_layer_split(126, 16) == (7, *[8] * 14, 7)
    assert balanced_layer_split(88, 16) == (5, *[6] * 8, *[5] * 7)
    assert balanced_layer_split(11, 4) == (2, 3, 3, 3)  # the last takes one once the middle has
    assert balanced_layer_split(5, 2) == (2, 3)
    assert balanced_layer_split(12, 4) is None  # divides: the trainer's even split
    for layers in range(2, 40):
        for pp in range(2, layers + 1):
            split = balanced_layer_split(layers, pp)
            if split is not None:
                assert sum(split) == layers and max(split) - min(split) == 1
                assert (
                    ParallelConfig(pp=pp, pp_layers_per_stage=split).check_model(
                        replace(DENSE, num_layers=layers), 64
                    )
                    is None
                )


def test_state_per_device_is_the_largest_stages_shard_of_the_state():
    # 11 layers on 2 stages (5 + 6), untied: the first stage holds the embedding, the last the
    # head and the final norm; fp32-master keeps 16 bytes a parameter, sharded over 2 ranks.
    params = Parameters.of(DENSE)
    model = replace(DENSE, num_layers=11)
    block = params.block_split + params.block_whole
    layout = Layout(pp=2, dp_shard=2, pp_layers_per_stage=(5, 6))
    first = 16 * (5 * block + params.embedding) / 2
    last = 16 * (6 * block + params.head + params.final_norm) / 2
    assert state_bytes_per_device(model, layout, "fp32-master", pp_rank=0) == first
    assert state_bytes_per_device(model, layout, "fp32-master", pp_rank=1) == last
    assert state_bytes_per_device(model, layout, "fp32-master") == max(first, last)
    assert state_bytes_per_device(model, Layout(tp=2, dp_shard=4), "pure-bf16") == pytest.approx(
        8 * (11 * (params.block_split / 2 + params.block_whole) + 2 * params.head / 2 + 256) / 4
    )
    # The breakdown's state term is the same function's, for the stage it reports.
    work = Workload(seq_len=64, micro_batch_size=1, global_batch_samples=4)
    worst = estimate(model, layout, work, 2**30)
    assert worst.state == state_bytes_per_device(model, layout, "fp32-master", worst.stage)


def test_the_trainers_layer_split_is_even_with_the_first_stages_one_more():
    from goodput.train.parallel.pipeline import layers_per_stage

    assert even_layer_split(13, 4) == [4, 3, 3, 3] and even_layer_split(8, 2) == [4, 4]
    for pp in range(1, 9):
        split = layers_per_stage(ParallelConfig(pp=pp), 13)  # what the pipeline cuts
        assert split == even_layer_split(13, pp) and sum(split) == 13
        assert max(split) - min(split) <= 1 and split == sorted(split, reverse=True)


def test_compute_bytes_follow_the_trainers_compute_dtype():
    from goodput.train.parallel.parallelize import compute_dtype

    for precision, policy in PRECISIONS.items():
        dtype = compute_dtype(ParallelConfig(precision=precision))  # type: ignore[arg-type]
        assert dtype.itemsize == policy.compute_bytes


def test_fsdp_shards_over_context_parallel_ranks_as_the_trainer_does():
    # dp 1 x cp 2 in fp32: the trainer's FSDP mesh is dp_shard x cp = 2 ranks, so FSDP is on
    # (weights gathered); one rank in fp32 has no FSDP at all.
    work = Workload(seq_len=64, micro_batch_size=1, global_batch_samples=1, precision="fp32")
    assert estimate(DENSE, Layout(cp=2), work, 2**30).gathered > 0
    assert estimate(DENSE, Layout(), work, 2**30).gathered == 0
