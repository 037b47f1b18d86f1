"""Muon: the rule against a plain transcription of it and against ``torch.optim.Muon``, its
refusals, and the split Newton–Schulz work on 2 and 4 real gloo ranks (plain replicas, FSDP2
shards, a 2x2 mesh) giving the bits of one process. What every kind owes the trainer (the
zero-gradient step checkpoint loading takes, resume, the AdamW side):
test_optimizer_contract.py."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from goodput.testing.dist import run_distributed
from goodput.testing.optimizers import matrix_groups, model_groups, random_problem, small_model
from goodput.train.optim import muon
from goodput.train.optim.muon import Muon

LR, WD, MU = 0.02, 0.1, 0.95


def transcribed_ns(m):
    """Five quintic iterations, as published: bf16, the small Gram, X / (‖X‖_F + 1e-7)."""
    x = m.to(torch.bfloat16)
    flip = m.shape[0] > m.shape[1]
    if flip:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        a = x @ x.mT
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * (a @ a)) @ x
    return x.mT if flip else x


def transcribed_muon(weights, grads_by_step, transposed, nesterov, rule):
    """The rule written out per matrix of each (stacked) weight."""
    weights = [w.clone() for w in weights]
    buffers = [torch.zeros_like(w) for w in weights]
    for grads in grads_by_step:
        for w, b, g, t in zip(weights, buffers, grads, transposed, strict=True):
            b.mul_(MU).add_(g)
            u = g + MU * b if nesterov else b
            rows, cols = w.shape[-2:]
            out, inp = (cols, rows) if t else (rows, cols)
            s = (
                0.2 * math.sqrt(max(out, inp))
                if rule == "match_rms_adamw"
                else math.sqrt(max(1, out / inp))
            )
            o = torch.stack([transcribed_ns(m) for m in u.reshape(-1, rows, cols)]).reshape(w.shape)
            w.mul_(1 - LR * WD)
            w.add_(o, alpha=-LR * s)
    return weights


def run_muon(weights, grads_by_step, transposed, **kwargs):
    params = [nn.Parameter(w.clone()) for w in weights]
    groups = matrix_groups(params, transposed)
    optimizer = Muon(groups, lr=LR, weight_decay=WD, momentum=MU, **kwargs)
    for grads in grads_by_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in params]


SHAPES = [(6, 4), (5, 7), (3, 4, 6)]  # tall, wide, a stack of 3 stored [in, out]
TRANSPOSED = [False, False, True]


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("rule", ["match_rms_adamw", "spectral"])
def test_muon_follows_its_transcription(nesterov, rule):
    weights, grads = random_problem(SHAPES)
    got = run_muon(weights, grads, TRANSPOSED, nesterov=nesterov, lr_rule=rule)
    want = transcribed_muon(weights, grads, TRANSPOSED, nesterov, rule)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert not torch.allclose(got[0], weights[0], atol=1e-3)  # it did move


def test_newton_schulz_brings_singular_values_near_one():
    m = torch.randn(16, 40) @ torch.diag(torch.logspace(-2, 0, 40))
    singular = torch.linalg.svdvals(muon.newton_schulz(m, 5).float())
    assert singular.min() > 0.3 and singular.max() < 1.5
    assert muon.newton_schulz(m.T, 5).shape == (40, 16)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize(
    ("rule", "torch_rule"), [("match_rms_adamw", "match_rms_adamw"), ("spectral", "original")]
)
def test_muon_agrees_with_torch_muon_on_2d_matrices(nesterov, rule, torch_rule):
    """torch's buffer is an EMA, (1 − μ) times ours, its NS clamps the norm instead of adding 1e-7
    and fuses b·A + c·A² into one addmm: equal in exact arithmetic (NS normalises the scale
    away), apart by bf16 rounding, which five steep iterations amplify on these tiny matrices (each
    NS is 1-4e-2 from a float64 one, torch's too). So: the total updates agree to 10 %; a wrong
    scale, sign or orientation is off by far more."""
    shapes = [(6, 4), (5, 7)]
    weights, grads = random_problem(shapes)
    ours = run_muon(weights, grads, [False, False], nesterov=nesterov, lr_rule=rule)
    params = [nn.Parameter(w.clone()) for w in weights]
    reference = torch.optim.Muon(
        params, lr=LR, weight_decay=WD, momentum=MU, nesterov=nesterov, adjust_lr_fn=torch_rule
    )
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        reference.step()
    for w, a, b in zip(weights, ours, params, strict=True):
        decayed = w * (1 - LR * WD) ** 3
        assert (a - b.detach()).norm() < 0.1 * (b.detach() - decayed).norm()


def test_unknown_lr_rule_and_unmarked_groups_are_refused():
    with pytest.raises(ValueError, match="lr_rule"):
        Muon(model_groups(small_model()), lr=LR, lr_rule="mup")
    with pytest.raises(ValueError, match="matrix"):
        Muon([{"params": list(small_model().parameters())}], lr=LR)


# --- distributed -------------------------------------------------------------------------------

PLAIN_SHAPES = [(6, 4), (5, 7), (3, 4, 6), (8, 8), (2, 3, 5)]
PLAIN_TRANSPOSED = [False, False, True, False, True]
NUM_PLAIN_MATRICES = sum(math.prod(shape[:-2]) for shape in PLAIN_SHAPES)  # 8


def counting_newton_schulz(counter):
    original = muon.newton_schulz

    def counted(matrix, steps):
        counter[0] += 1
        return original(matrix, steps)

    return counted


def replicated_rank(rank, world_size):
    """Plain tensors, the same on every rank, the default group their replicas."""
    torch.set_num_threads(1)
    calls = [0]
    muon.newton_schulz = counting_newton_schulz(calls)
    weights, grads = random_problem(PLAIN_SHAPES)
    split = run_muon(
        weights, grads, PLAIN_TRANSPOSED, nesterov=True, replica_group=dist.group.WORLD
    )
    split_calls, calls[0] = calls[0], 0
    everywhere = run_muon(
        weights,
        grads,
        PLAIN_TRANSPOSED,
        nesterov=True,
        replica_group=dist.group.WORLD,
        distribute=False,
    )
    return split, split_calls, everywhere, calls[0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_replicated_params_split_newton_schulz_and_get_one_process_bits(world_size):
    weights, grads = random_problem(PLAIN_SHAPES)
    alone = run_muon(weights, grads, PLAIN_TRANSPOSED, nesterov=True)
    results = run_distributed(replicated_rank, world_size)
    for rank, (split, split_calls, everywhere, everywhere_calls) in enumerate(results):
        for a, b, c in zip(split, everywhere, alone, strict=True):
            assert torch.equal(a, c) and torch.equal(b, c)
        mine = len(range(rank, NUM_PLAIN_MATRICES, world_size))
        assert split_calls == 3 * mine
        assert everywhere_calls == 3 * NUM_PLAIN_MATRICES


def full_grads(model, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) for p in model.parameters()]


def step_with(model, optimizer, num_steps):
    """Set the same full gradients (sharded like each parameter) and step."""
    for step in range(num_steps):
        for p, g in zip(model.parameters(), full_grads(model, step), strict=True):
            if isinstance(p, torch.distributed.tensor.DTensor):
                g = distribute_tensor(g, p.device_mesh, p.placements)
            p.grad = g
        optimizer.step()


def fsdp_rank(rank, world_size):
    """The small model under FSDP2 on a 1-D mesh, NS split and not: parameters, NS calls."""
    torch.set_num_threads(1)
    calls = [0]
    muon.newton_schulz = counting_newton_schulz(calls)
    mesh = init_device_mesh("cpu", (world_size,))
    results = []
    for distribute in (True, False):
        model = small_model()  # 6x4, 5x6 (5 rows: uneven on 2 and 4 ranks), 3x5
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        step_with(model, Muon(model_groups(model), lr=LR, nesterov=True, distribute=distribute), 3)
        results.append(([p.full_tensor() for p in model.parameters()], calls[0]))
        calls[0] = 0
    return results


def muon_alone_on_small_model():
    model = small_model()
    step_with(model, Muon(model_groups(model), lr=LR, nesterov=True), 3)
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_sharded_params_get_one_process_bits(world_size):
    alone = muon_alone_on_small_model()
    results = run_distributed(fsdp_rank, world_size)
    for split, everywhere in results:
        for params, _ in (split, everywhere):
            for a, b in zip(params, alone, strict=True):
                assert torch.equal(a, b)
    split_calls = [split[1] for split, _ in results]
    assert sum(split_calls) == 9  # 3 matrices a step, each computed on one rank
    assert max(split_calls) == 3 * math.ceil(3 / world_size)
    assert [everywhere[1] for _, everywhere in results] == [9] * world_size


MESH_LAYOUTS = [  # shape, transposed, placements on a (2, 2) mesh
    ((6, 4), False, [Shard(0), Shard(1)]),  # FSDP x TP colwise
    ((5, 6), False, [Shard(1), Shard(0)]),  # TP rowwise on dim 0 of the mesh, uneven rows
    ((7, 4), False, [Replicate(), Shard(0)]),  # HSDP
    ((4, 6, 2), True, [Shard(0), Replicate()]),  # split experts: whole matrices on each rank
    ((2, 3, 5), True, [Shard(2), Replicate()]),  # experts tensor-parallel in their out dim
]
MESH_SHAPES = [shape for shape, _, _ in MESH_LAYOUTS]
MESH_TRANSPOSED = [t for _, t, _ in MESH_LAYOUTS]


def mesh_rank(rank, world_size):
    torch.set_num_threads(1)
    calls = [0]
    muon.newton_schulz = counting_newton_schulz(calls)
    mesh = init_device_mesh("cpu", (2, 2))
    _, grads = random_problem(MESH_SHAPES)
    results = []
    for distribute in (True, False):
        params = [
            nn.Parameter(distribute_tensor(w, mesh, placements))
            for w, (_, _, placements) in zip(
                random_problem(MESH_SHAPES)[0], MESH_LAYOUTS, strict=True
            )
        ]
        optimizer = Muon(matrix_groups(params, MESH_TRANSPOSED), lr=LR, distribute=distribute)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = distribute_tensor(g, mesh, p.placements)
            optimizer.step()
        results.append(([p.full_tensor() for p in params], calls[0]))
        calls[0] = 0
    return results


def test_a_2x2_mesh_gets_one_process_bits():
    params = [nn.Parameter(w.clone()) for w in random_problem(MESH_SHAPES)[0]]
    optimizer = Muon(matrix_groups(params, MESH_TRANSPOSED), lr=LR)
    _, grads = random_problem(MESH_SHAPES)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    results = run_distributed(mesh_rank, 4)
    for split, everywhere in results:
        for got, _ in (split, everywhere):
            for a, b in zip(got, params, strict=True):
                assert torch.equal(a, b)
    # Gathered: 1 + 1 + 1 + 2 matrices a step, matrix j on rank j mod 4; split experts: 2 of
    # their own on each rank.
    assert [split[1] for split, _ in results] == [3 * (2 + 2)] + [3 * (1 + 2)] * 3
    assert [everywhere[1] for _, everywhere in results] == [3 * 7] * 4
