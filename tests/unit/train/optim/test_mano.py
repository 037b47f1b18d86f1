"""Mano: the rule against a plain transcription of Algorithm 1, its invariants (update RMS 0.2·lr,
the step tangent to the normalised weight, one axis a step for every matrix), and sharded
parameters on 2 and 4 real gloo ranks (FSDP2, a 2x2 mesh) matching one process without ever
gathering a matrix. What every kind owes the trainer (the zero-gradient step, resume, the AdamW
side): test_optimizer_contract.py."""

import math

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from goodput.testing.dist import run_distributed
from goodput.testing.optimizers import matrix_groups, model_groups, random_problem, small_model
from goodput.train.optim.mano import Mano

LR, WD, MU, EPS = 0.02, 0.1, 0.95, 1e-8


def transcribed_mano(weights, grads_by_step, transposed, nesterov):
    weights = [w.clone() for w in weights]
    momenta = [torch.zeros_like(w) for w in weights]
    for t, grads in enumerate(grads_by_step):
        for w, m, g, flipped in zip(weights, momenta, grads, transposed, strict=True):
            m.mul_(MU).add_(g)
            u = g + MU * m if nesterov else m
            dim = (-2, -1)[t % 2]
            if flipped:  # [in, out]: a column of [out, in] is a row here
                dim = -3 - dim
            theta_hat = w / w.norm(dim=dim, keepdim=True).clamp_min(EPS)
            v = u - theta_hat * (u * theta_hat).sum(dim, keepdim=True)
            v_hat = v / v.norm(dim=dim, keepdim=True).clamp_min(EPS)
            w.mul_(1 - LR * WD)
            w.add_(v_hat, alpha=-LR * 0.2 * math.sqrt(w.shape[dim]))
    return weights


def run_mano(weights, grads_by_step, transposed, weight_decay=WD, **kwargs):
    params = [nn.Parameter(w.clone()) for w in weights]
    groups = matrix_groups(params, transposed)
    optimizer = Mano(groups, lr=LR, weight_decay=weight_decay, momentum=MU, eps=EPS, **kwargs)
    for grads in grads_by_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params], optimizer


SHAPES = [(6, 4), (5, 7), (3, 4, 6)]
TRANSPOSED = [False, False, True]


@pytest.mark.parametrize("nesterov", [False, True])
def test_mano_follows_its_transcription(nesterov):
    weights, grads = random_problem(SHAPES, num_steps=4)
    got, _ = run_mano(weights, grads, TRANSPOSED, nesterov=nesterov)
    want = transcribed_mano(weights, grads, TRANSPOSED, nesterov)
    for a, b, w in zip(got, want, weights, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
        assert not torch.allclose(a, w, atol=1e-3)


def test_the_step_is_unit_tangent_rms_02_lr_and_its_axis_alternates_once_a_step():
    """Two matrices in two groups, stepped one step at a time with no decay: each step's
    V̂ = −Δθ / (0.2·lr·√n) has unit norm and is orthogonal to θ̂ along the step's axis — the
    columns (dim −2) at steps 1 and 3, the rows at 2 and 4, for both alike."""
    weights, grads = random_problem([(8, 5), (6, 9)], num_steps=4)
    params = [nn.Parameter(w.clone()) for w in weights]
    optimizer = Mano(
        [{"params": [p], "matrix": True} for p in params], lr=LR, weight_decay=0.0, eps=EPS
    )
    for step, step_grads in enumerate(grads):
        dim = (-2, -1)[step % 2]
        before = [p.detach().clone() for p in params]
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g
        optimizer.step()
        for p, old in zip(params, before, strict=True):
            delta = p.detach() - old
            assert delta.square().mean().sqrt() == pytest.approx(0.2 * LR, rel=0.01)
            v_hat = -delta / (0.2 * LR * math.sqrt(p.shape[dim]))
            theta_hat = old / old.norm(dim=dim, keepdim=True)
            assert torch.allclose(v_hat.norm(dim=dim), torch.ones(()), atol=1e-5)
            assert torch.allclose((v_hat * theta_hat).sum(dim), torch.zeros(()), atol=1e-5)
            other = -1 - (dim % 2)  # the norms along the other axis are not all 1
            assert not torch.allclose(v_hat.norm(dim=other), torch.ones(()), atol=1e-2)
            assert optimizer.state[p]["step"].item() == step + 1


def test_a_matrix_that_missed_a_step_rejoins_the_common_axis():
    weights, grads = random_problem([(6, 4), (5, 7)], num_steps=3)
    params = [nn.Parameter(w.clone()) for w in weights]
    optimizer = Mano([{"params": params, "matrix": True}], lr=LR, eps=EPS)
    for step, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if (step == 1 and p is params[1]) else g
        before = params[1].detach().clone()
        optimizer.step()
    # Step 3 normalised along the columns (dim −2), the second matrix's own second step included.
    v_hat = (before * (1 - LR * WD) - params[1].detach()) / (0.2 * LR * math.sqrt(5))
    assert torch.allclose(v_hat.norm(dim=-2), torch.ones(()), atol=1e-5)
    assert [optimizer.state[p]["step"].item() for p in params] == [3, 3]


# --- distributed -------------------------------------------------------------------------------

MESH_LAYOUTS = [  # shape, transposed, placements on a (2, 2) mesh
    ((6, 4), False, [Shard(0), Shard(1)]),  # FSDP x TP colwise: both sums split
    ((5, 6), False, [Shard(1), Shard(0)]),  # uneven rows
    ((7, 4), False, [Replicate(), Shard(0)]),  # HSDP
    ((4, 6, 2), True, [Shard(0), Replicate()]),  # split experts: no sum split
    ((2, 3, 5), True, [Shard(2), Shard(1)]),  # experts sharded along both matrix dims
]
MESH_SHAPES = [shape for shape, _, _ in MESH_LAYOUTS]
MESH_TRANSPOSED = [t for _, t, _ in MESH_LAYOUTS]


def grads_like(params, seed):
    """Three steps of full gradients, sharded like each parameter (all made before stepping,
    so that distributing them is not mistaken for the optimizer gathering)."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(3):
        grads = []
        for p in params:
            g = torch.randn(p.shape, generator=generator)
            grads.append(distribute_tensor(g, p.device_mesh, p.placements))
        steps.append(grads)
    return steps


def refuse_to_gather(*args, **kwargs):
    raise AssertionError("Mano gathered a sharded tensor")


def step_sharded(params, groups):
    steps = grads_like(params, seed=1)
    full_tensor, redistribute = DTensor.full_tensor, DTensor.redistribute
    DTensor.full_tensor = refuse_to_gather  # type: ignore[method-assign]
    DTensor.redistribute = refuse_to_gather  # type: ignore[method-assign]
    optimizer = Mano(groups, lr=LR, eps=EPS, nesterov=True)
    for grads in steps:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        optimizer.step()
    DTensor.full_tensor, DTensor.redistribute = full_tensor, redistribute  # type: ignore[method-assign]
    return [p.full_tensor() for p in params]


def step_alone(params, groups):
    generator = torch.Generator().manual_seed(1)
    steps = [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(3)]
    optimizer = Mano(groups, lr=LR, eps=EPS, nesterov=True)
    for grads in steps:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        optimizer.step()
    return [p.detach() for p in params]


def sharded_rank(rank, world_size):
    """FSDP2 over all ranks, and on 4 ranks a 2x2 mesh of mixed layouts."""
    torch.set_num_threads(1)
    model = small_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdp = step_sharded(list(model.parameters()), model_groups(model))
    if world_size != 4:
        return fsdp, None
    mesh_2d = init_device_mesh("cpu", (2, 2))
    params = [
        nn.Parameter(distribute_tensor(w, mesh_2d, placements))
        for w, (_, _, placements) in zip(random_problem(MESH_SHAPES)[0], MESH_LAYOUTS, strict=True)
    ]
    return fsdp, step_sharded(params, matrix_groups(params, MESH_TRANSPOSED))


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_params_match_one_process_without_gathering(world_size):
    model = small_model()
    fsdp_alone = step_alone(list(model.parameters()), model_groups(model))
    params = [nn.Parameter(w.clone()) for w in random_problem(MESH_SHAPES)[0]]
    mesh_alone = step_alone(params, matrix_groups(params, MESH_TRANSPOSED))
    for fsdp, mesh in run_distributed(sharded_rank, world_size):
        for a, b in zip(fsdp, fsdp_alone, strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=0)
        if world_size == 4:
            for a, b in zip(mesh, mesh_alone, strict=True):
                assert torch.allclose(a, b, atol=1e-6, rtol=0)
