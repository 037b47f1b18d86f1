"""LAMB: several steps against a transcription of the rule tensor by tensor, the trust ratio's
edge cases (zero weight, zero update, the weight-norm clamp), and a 2x2 mesh of
Shard(0)/Shard(1) DTensors on 4 gloo ranks against one process. What every kind owes the
trainer (checkpointing's initialisation step, resume, FSDP2): test_optimizer_contract.py."""

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

from goodput.testing.dist import run_distributed
from goodput.testing.optimizers import LAYOUTS_2D
from goodput.train.optim.lamb import Lamb

BETAS = (0.9, 0.95)
EPS = 1e-8


def transcribed_lamb(weight, grads, *, lr, weight_decay, max_weight_norm):
    """The LAMB rule for one tensor over ``grads`` (one per step), written out; also whether
    the weight norm was clamped at any step."""
    beta1, beta2 = BETAS
    m = torch.zeros_like(weight)
    v = torch.zeros_like(weight)
    clamped = False
    for t, g in enumerate(grads, start=1):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        u = m_hat / (torch.sqrt(v_hat) + EPS) + weight_decay * weight
        weight_norm = float(torch.linalg.norm(weight))
        update_norm = float(torch.linalg.norm(u))
        clamped = clamped or weight_norm > max_weight_norm
        if weight_norm > 0 and update_norm > 0:
            trust_ratio = min(weight_norm, max_weight_norm) / update_norm
        else:
            trust_ratio = 1.0
        weight = weight - lr * trust_ratio * u
    return weight, clamped


def one_step(weight, grad, **kwargs):
    parameter = nn.Parameter(weight.clone())
    parameter.grad = grad
    Lamb([parameter], **kwargs).step()
    return parameter.detach()


def test_steps_follow_the_transcribed_rule_per_tensor():
    torch.manual_seed(0)
    large = torch.randn(6, 4, dtype=torch.float64)
    large *= 30 / torch.linalg.norm(large)  # above max_weight_norm: the clamp acts
    weights = [
        large,
        0.2 * torch.randn(3, 5, dtype=torch.float64),
        torch.ones(5, dtype=torch.float64),
    ]
    decays = [0.1, 0.1, 0.0]
    grads = [[torch.randn_like(w) for _ in range(5)] for w in weights]
    parameters = [nn.Parameter(w.clone()) for w in weights]
    optimizer = Lamb(
        [
            {"params": parameters[:2], "weight_decay": 0.1},
            {"params": parameters[2:], "weight_decay": 0.0},
        ],
        lr=0.01,
        betas=BETAS,
        eps=EPS,
        max_weight_norm=10.0,
    )
    for step in range(5):
        for parameter, tensor_grads in zip(parameters, grads, strict=True):
            parameter.grad = tensor_grads[step]
        optimizer.step()
    clamps = []
    for parameter, weight, decay, tensor_grads in zip(
        parameters, weights, decays, grads, strict=True
    ):
        expected, clamped = transcribed_lamb(
            weight, tensor_grads, lr=0.01, weight_decay=decay, max_weight_norm=10.0
        )
        clamps.append(clamped)
        assert torch.allclose(parameter.detach(), expected, rtol=0, atol=1e-12)
    assert clamps == [True, False, False]
    assert set(optimizer.state[parameters[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert optimizer.state[parameters[0]]["step"].item() == 5


def test_a_zero_weight_takes_the_adam_step_unscaled():
    # ρ = min(‖θ‖, ·)/‖u‖ would be 0 and a zero-initialised tensor could never move.
    grad = torch.randn(4, 3, dtype=torch.float64)
    stepped = one_step(torch.zeros(4, 3, dtype=torch.float64), grad, lr=0.01, eps=EPS)
    assert torch.allclose(stepped, -0.01 * grad / (grad.abs() + EPS), rtol=0, atol=1e-15)


def test_a_zero_update_changes_nothing_and_makes_no_nan():
    # ‖u‖ = 0 (zero gradient, no decay) would give ρ = ‖θ‖/0 and 0·inf = NaN.
    weight = torch.randn(4, 3)
    stepped = one_step(weight, torch.zeros(4, 3), lr=0.01, weight_decay=0.0)
    assert torch.equal(stepped, weight)


def test_the_step_is_lr_times_the_weight_norm_clamped_at_max_weight_norm():
    torch.manual_seed(0)
    for weight_norm, step_norm in ((2.0, 2.0), (50.0, 10.0)):
        weight = torch.randn(5, 4, dtype=torch.float64)
        weight *= weight_norm / torch.linalg.norm(weight)
        stepped = one_step(weight, torch.randn_like(weight), lr=0.01, max_weight_norm=10.0)
        assert abs(float(torch.linalg.norm(stepped - weight)) - 0.01 * step_norm) < 1e-12


def lamb_on_a_2d_mesh(rank, world_size):
    """Max gap between DTensors on a 2x2 mesh and whole tensors in this process, 3 steps."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    wholes = [torch.randn(shape) for shape, *_ in LAYOUTS_2D]
    wholes[0] *= 20  # past max_weight_norm
    sharded = [
        nn.Parameter(distribute_tensor(whole, mesh, placements))
        for whole, (_, placements, _, _) in zip(wholes, LAYOUTS_2D, strict=True)
    ]
    plain = [nn.Parameter(whole.clone()) for whole in wholes]
    decays = [decay for *_, decay in LAYOUTS_2D]
    optimizers = [
        Lamb([{"params": [p], "weight_decay": d} for p, d in zip(ps, decays, strict=True)], lr=0.05)
        for ps in (sharded, plain)
    ]
    for _ in range(3):
        for p, q, (shape, _, grad_placements, _) in zip(sharded, plain, LAYOUTS_2D, strict=True):
            grad = torch.randn(shape)
            p.grad = distribute_tensor(grad, mesh, grad_placements)
            q.grad = grad
        for optimizer in optimizers:
            optimizer.step()
    return max(
        (p.full_tensor() - q).abs().max().item() for p, q in zip(sharded, plain, strict=True)
    )


def test_dtensors_on_a_2d_mesh_step_as_whole_tensors():
    assert max(run_distributed(lamb_on_a_2d_mesh, 4, timeout_s=120)) < 1e-6
