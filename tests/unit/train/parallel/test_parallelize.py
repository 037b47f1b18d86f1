"""FSDP2 on gloo: the same loss and the same update as one process, with gradients reduced
once per step or after every micro-batch; precision policies in effect."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL, rank_micro_batches, uneven_global_batch
from goodput.train.config.model import MoEConfig
from goodput.train.config.parallel import ParallelConfig
from goodput.train.model import Transformer
from goodput.train.parallel.parallelize import parallelize
from goodput.train.step import StepSettings, train_step


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def fsdp_step(rank, world_size, precision, accumulation):
    torch.manual_seed(0)
    model = parallelize(Transformer(TINY_MODEL), ParallelConfig(precision=precision))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = rank_micro_batches(*uneven_global_batch(), rank, world_size, accumulation)
    result = train_step(model, optimizer, micro, StepSettings(max_grad_norm=None))
    weight = full(model.output.weight)
    return result.loss, result.grad_norm, weight[:3, :3].clone(), str(weight.dtype)


def single_step(precision):
    torch.manual_seed(0)
    model = parallelize(
        Transformer(TINY_MODEL), ParallelConfig(data_parallel="replicate", precision=precision)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, labels = uneven_global_batch()
    result = train_step(model, optimizer, [(inputs, labels)], StepSettings(max_grad_norm=None))
    return result.loss, result.grad_norm, model.output.weight[:3, :3].detach().clone()


def test_fsdp_fp32_matches_one_process():
    loss, grad_norm, weights = single_step("fp32")
    for rank_loss, rank_norm, rank_weights, dtype in run_distributed(fsdp_step, 2, "fp32", 2):
        assert rank_loss == pytest.approx(loss, rel=1e-5)
        assert rank_norm == pytest.approx(grad_norm, rel=1e-4)
        assert torch.allclose(rank_weights, weights, atol=1e-6) and dtype == "torch.float32"


def test_fp32_master_keeps_fp32_weights_but_computes_in_bf16():
    results = run_distributed(fsdp_step, 2, "fp32-master", 1)
    loss, _, weights = single_step("fp32")
    for rank_loss, _, rank_weights, dtype in results:
        assert dtype == "torch.float32"  # master weights
        assert rank_loss == pytest.approx(loss, rel=2e-2)  # bf16 compute: close, not equal
        assert rank_loss != pytest.approx(loss, rel=1e-6)
        assert torch.allclose(rank_weights, weights, atol=1e-2)


def test_pure_bf16_stores_bf16_weights_and_keeps_its_buffers_fp32():
    model = parallelize(
        Transformer(replace(TINY_MODEL, tie_embeddings=True, moe=MoEConfig(num_experts=2))),
        ParallelConfig(data_parallel="replicate", precision="pure-bf16"),
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.output.weight is model.embedding.weight  # still one weight
    # bf16 rotary frequencies are off by ~0.4 rad at position 4096; bf16 counts stop at 256.
    assert {b.dtype for b in model.buffers()} == {torch.float32}
    model(torch.zeros(1, 4, dtype=torch.long))  # and the forward takes them as they are


def is_sharded(rank, world_size, precision):
    model = parallelize(Transformer(TINY_MODEL), ParallelConfig(precision=precision))
    return isinstance(model, FSDPModule)


def test_one_rank_skips_fsdp_unless_the_policy_needs_it():
    assert run_distributed(is_sharded, 1, "fp32") == [False]
    assert run_distributed(is_sharded, 1, "fp32-master") == [True]  # bf16 compute comes from FSDP
    assert run_distributed(is_sharded, 2, "fp32") == [True, True]


def accumulated_steps(rank, world_size, sync_every_micro_batch):
    """Two steps of 4 micro-batches: (losses, grad norms, weights, reduce-scatters)."""
    calls = []
    reduce_scatter = dist.reduce_scatter_single

    def counted(*args, **kwargs):
        calls.append(1)
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counted  # FSDP2's one reduce-scatter, in this process only
    torch.manual_seed(0)
    model = parallelize(Transformer(TINY_MODEL), ParallelConfig(precision="fp32"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = rank_micro_batches(*uneven_global_batch(), rank, world_size, accumulation=4)
    results = [
        train_step(
            model,
            optimizer,
            micro,
            StepSettings(max_grad_norm=None, sync_every_micro_batch=sync_every_micro_batch),
        )
        for _ in range(2)
    ]
    weights = full(model.output.weight)[:3, :3].clone()
    return [r.loss for r in results], [r.grad_norm for r in results], weights, len(calls)


def test_accumulation_reduces_once_a_step_and_trains_the_same():
    once = run_distributed(accumulated_steps, 2, False)
    every = run_distributed(accumulated_steps, 2, True)
    num_units = TINY_MODEL.num_layers + 1  # FSDP units: each block, and the root
    assert [r[3] for r in once] == [2 * num_units] * 2  # one reduce-scatter a unit and step
    assert [r[3] for r in every] == [2 * 4 * num_units] * 2  # one a micro-batch
    for (losses, norms, weights, _), (every_losses, every_norms, every_weights, _) in zip(
        once, every, strict=True
    ):
        assert losses == pytest.approx(every_losses, rel=1e-6)
        assert norms == pytest.approx(every_norms, rel=1e-5)
        assert torch.allclose(weights, every_weights, atol=1e-7)
    loss, grad_norm, _ = single_step("fp32")
    assert once[0][0][0] == pytest.approx(loss, rel=1e-5)
    assert once[0][1][0] == pytest.approx(grad_norm, rel=1e-4)
