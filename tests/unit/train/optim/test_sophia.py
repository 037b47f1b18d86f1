"""SophiaG: steps and Hessian updates against a transcription of the rule (the clip acting on
some coordinates and not on others), the signSGD step before any Hessian estimate, B_h
recorded and used, and FSDP2 on 2 gloo ranks and a 2x2 mesh of Shard(0)/Shard(1) DTensors on 4
against one process — parameters and win rate. What every kind owes the trainer
(checkpointing's initialisation step, resume): test_optimizer_contract.py."""

import json

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

from goodput.testing.dist import run_distributed
from goodput.testing.optimizers import LAYOUTS_2D, backward_on_shares, sharded_and_whole
from goodput.train.optim.sophia import SophiaG

BETAS = (0.965, 0.99)
RHO = 0.04
EPS = 1e-15


def transcribed_sophia(weights, decays, events, *, lr):
    """The SophiaG rule over ``events`` — ("step", grads) or ("hessian", grads, num_tokens) —
    written out for a list of tensors; the weights and each step's unclipped fraction."""
    beta1, beta2 = BETAS
    weights = [w.clone() for w in weights]
    m = [torch.zeros_like(w) for w in weights]
    h = [torch.zeros_like(w) for w in weights]
    hessian_tokens = 0
    fractions = []
    for kind, grads, *num_tokens in events:
        if kind == "hessian":
            h = [beta2 * hi + (1 - beta2) * g * g for hi, g in zip(h, grads, strict=True)]
            hessian_tokens = num_tokens[0]
            continue
        unclipped = 0
        for i, g in enumerate(grads):
            weights[i] = weights[i] * (1 - lr * decays[i])
            m[i] = beta1 * m[i] + (1 - beta1) * g
            ratio = torch.minimum(
                m[i].abs() / (RHO * hessian_tokens * h[i] + EPS), torch.ones_like(m[i])
            )
            unclipped += int((m[i].abs() / (RHO * hessian_tokens * h[i] + EPS) < 1).sum())
            weights[i] = weights[i] - lr * torch.sign(m[i]) * ratio
        fractions.append(unclipped / sum(w.numel() for w in weights))
    return weights, fractions


def run_events(parameters, optimizer, events):
    fractions = []
    for kind, grads, *num_tokens in events:
        for parameter, grad in zip(parameters, grads, strict=True):
            parameter.grad = grad.clone()
        if kind == "hessian":
            optimizer.update_hessian(*num_tokens)
        else:
            optimizer.step()
            fractions.append(optimizer.last_unclipped_fraction)
    return fractions


def test_steps_and_hessian_updates_follow_the_transcribed_rule():
    torch.manual_seed(0)
    weights = [torch.randn(6, 4, dtype=torch.float64), torch.ones(5, dtype=torch.float64)]
    decays = [0.1, 0.0]

    def grads(scale=1.0):
        # Magnitudes over four decades, so |m| / (ρ·B_h·h) falls on both sides of 1.
        return [
            scale * torch.randn_like(w) * torch.logspace(-2, 2, w.numel()).view_as(w).to(w)
            for w in weights
        ]

    events = [
        ("step", grads()),
        ("hessian", grads(), 64),
        ("step", grads()),
        ("step", grads()),
        ("hessian", grads(), 128),
        ("step", grads()),
    ]
    parameters = [nn.Parameter(w.clone()) for w in weights]
    optimizer = SophiaG(
        [
            {"params": parameters[:1], "weight_decay": 0.1},
            {"params": parameters[1:], "weight_decay": 0.0},
        ],
        lr=0.01,
        betas=BETAS,
        rho=RHO,
        eps=EPS,
    )
    assert optimizer.last_unclipped_fraction is None
    fractions = run_events(parameters, optimizer, events)
    expected_weights, expected_fractions = transcribed_sophia(weights, decays, events, lr=0.01)
    for parameter, expected in zip(parameters, expected_weights, strict=True):
        assert torch.allclose(parameter.detach(), expected, rtol=0, atol=1e-12)
    assert fractions == expected_fractions
    assert fractions[0] == 0.0 and all(0.1 < f < 0.9 for f in fractions[1:])  # both sides
    assert set(optimizer.state[parameters[0]]) == {"step", "exp_avg", "hessian"}
    assert optimizer.state[parameters[0]]["step"].item() == 4


def test_before_any_hessian_estimate_every_coordinate_steps_lr_times_sign():
    torch.manual_seed(0)
    weight, grad = torch.randn(5, 3), torch.randn(5, 3)
    parameter = nn.Parameter(weight.clone())
    parameter.grad = grad
    optimizer = SophiaG([parameter], lr=0.01, weight_decay=0.1)
    optimizer.step()
    assert torch.equal(parameter.detach(), weight * (1 - 0.01 * 0.1) - 0.01 * torch.sign(grad))
    assert optimizer.last_unclipped_fraction == 0.0


def stepped_once_after_a_hessian(rho, num_tokens):
    torch.manual_seed(0)
    parameter = nn.Parameter(torch.randn(4, 4))
    optimizer = SophiaG([parameter], lr=0.01, rho=rho)
    parameter.grad = torch.randn(4, 4)
    optimizer.update_hessian(num_tokens)
    parameter.grad = 0.01 * torch.randn(4, 4)
    optimizer.step()
    return parameter.detach(), optimizer


def test_the_hessian_batch_tokens_are_recorded_saved_and_scale_the_clip():
    reference, optimizer = stepped_once_after_a_hessian(rho=0.04, num_tokens=100)
    groups = optimizer.state_dict()["param_groups"]
    assert [g["hessian_tokens"] for g in groups] == [100]
    assert json.loads(json.dumps(groups))[0]["hessian_tokens"] == 100
    # Only ρ·B_h counts: half the ρ on twice the tokens is the same step, twice the tokens alone
    # is not.
    assert torch.equal(stepped_once_after_a_hessian(rho=0.02, num_tokens=200)[0], reference)
    assert not torch.equal(stepped_once_after_a_hessian(rho=0.04, num_tokens=200)[0], reference)


def groups(model):
    parameters = list(model.parameters())
    return [
        {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0},
    ]


HESSIAN_SCALE = 10.0


def sophia_under_fsdp(rank, world_size):
    """Max gap between an FSDP2-sharded model (each rank its own slice of the batch) and the
    same model stepped in this process on the whole batch — step, Hessian estimate, 2 steps —
    and both models' unclipped fractions after each step."""
    torch.set_num_threads(1)
    model, reference = sharded_and_whole(init_device_mesh("cpu", (world_size,)))
    optimizers = [SophiaG(groups(m), lr=0.05, rho=RHO) for m in (model, reference)]
    torch.manual_seed(1)
    fractions = []
    for step in range(3):
        if step == 1:  # a stand-in for the sampled-label loss, scaled so the clip acts both ways
            rows = backward_on_shares(model, reference, rank, world_size, scale=HESSIAN_SCALE)
            for optimizer in optimizers:
                optimizer.update_hessian(num_tokens=rows)
                optimizer.zero_grad()
        backward_on_shares(model, reference, rank, world_size)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        fractions.append([optimizer.last_unclipped_fraction for optimizer in optimizers])
    gap = max(
        (p.full_tensor() - r).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    return gap, fractions


def assert_same_steps_and_win_rates(results):
    for gap, fractions in results:
        assert gap < 1e-6
        for sharded, whole in fractions:
            assert abs(sharded - whole) < 1e-12
        assert fractions[0] == [0.0, 0.0]  # no Hessian yet: all clipped
        assert all(0 < whole < 1 for _, whole in fractions[1:])  # the clip both ways


def test_fsdp_sharded_steps_and_win_rate_equal_one_process():
    assert_same_steps_and_win_rates(run_distributed(sophia_under_fsdp, 2, timeout_s=120))


def sophia_on_a_2d_mesh(rank, world_size):
    """As ``sophia_under_fsdp``, for DTensors on a 2x2 mesh against whole tensors."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    sharded, plain = [], []
    for shape, placements, _, _ in LAYOUTS_2D:
        whole = torch.randn(shape)
        sharded.append(nn.Parameter(distribute_tensor(whole, mesh, placements)))
        plain.append(nn.Parameter(whole))
    decays = [decay for *_, decay in LAYOUTS_2D]
    optimizers = [
        SophiaG(
            [{"params": [p], "weight_decay": d} for p, d in zip(ps, decays, strict=True)], lr=0.05
        )
        for ps in (sharded, plain)
    ]

    def set_grads(scale):
        for p, q, (shape, _, grad_placements, _) in zip(sharded, plain, LAYOUTS_2D, strict=True):
            grad = scale * torch.randn(shape)
            p.grad = distribute_tensor(grad, mesh, grad_placements)
            q.grad = grad

    fractions = []
    for step in range(3):
        if step == 1:
            set_grads(scale=3.0)
            for optimizer in optimizers:
                optimizer.update_hessian(num_tokens=16)
        set_grads(scale=1.0)
        for optimizer in optimizers:
            optimizer.step()
        fractions.append([optimizer.last_unclipped_fraction for optimizer in optimizers])
    gap = max((p.full_tensor() - q).abs().max().item() for p, q in zip(sharded, plain, strict=True))
    return gap, fractions


def test_dtensors_on_a_2d_mesh_step_as_whole_tensors_with_the_same_win_rate():
    assert_same_steps_and_win_rates(run_distributed(sophia_on_a_2d_mesh, 4, timeout_s=120))
