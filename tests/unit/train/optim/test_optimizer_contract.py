"""What every optimizer kind owes the trainer, each built as the trainer builds it (``optim.KINDS``
through ``Optimizers``): the zero-gradient lr = 0 step that distributed checkpointing takes to
build a fresh state changes nothing and leaves the state a real step makes; a resume through the
state dicts is bit-exact, settings included; FSDP2 on 2 gloo ranks steps as one process; and
the AdamW side of a matrix kind is ``torch.optim.AdamW``. The rules themselves are each kind's
own test (test_lamb.py, test_sophia.py, test_muon.py, test_mano.py)."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from goodput.testing.dist import run_distributed
from goodput.testing.optimizers import backward_on_shares, sharded_and_whole
from goodput.train.config.optim import MATRIX_KINDS, OptimConfig
from goodput.train.optim.optimizers import KINDS, Optimizers

LR = 0.05


def config(kind):
    # A Hessian estimate every other step, so that a resume carries one and makes more.
    return OptimConfig(kind=kind, **({"sophia_hessian_interval": 2} if kind == "sophiag" else {}))


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def model_and_optimizer(kind):
    model = small_model()
    return model, Optimizers([model], config(kind), lr=LR)


def train(model, optimizers, batches, first_step=1):
    """Steps as the trainer takes them: SophiaG's Hessian estimate (a stand-in loss, B_h the
    batch's rows) after the steps ``wants_hessian`` names."""
    for step, x in enumerate(batches, start=first_step):
        model(x).square().mean().backward()
        optimizers.step()
        optimizers.zero_grad()
        if optimizers.wants_hessian(step):
            model(x).sum().backward()
            optimizers.update_hessian(len(x))
            optimizers.zero_grad()


def state_keys(optimizer):
    return [sorted(state) for state in optimizer.state_dict()["state"].values()]


@pytest.mark.parametrize("kind", KINDS)
def test_checkpointings_zero_gradient_initialisation_step_changes_nothing(kind):
    model, optimizers = model_and_optimizer(kind)
    with torch.no_grad():
        model[0].bias.zero_()  # ‖θ‖ = 0 with a zero update too
        model[4].weight.zero_()  # a zero-initialised output projection
    before = copy.deepcopy(model.state_dict())
    optimizer = optimizers.optimizers[0]
    _, optimizer_state = get_state_dict(model, optimizer)  # steps once, lr = 0, zero grads
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    for state in optimizer_state["state"].values():
        assert all(torch.isfinite(value).all() for value in state.values())
    stepped, stepped_optimizers = model_and_optimizer(kind)
    train(stepped, stepped_optimizers, [torch.randn(8, 4)])
    assert state_keys(optimizer) == state_keys(stepped_optimizers.optimizers[0])


def settings(optimizer):
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_from_the_state_dicts_is_bit_exact(kind):
    batches = list(torch.randn(5, 8, 4))
    straight, straight_optimizers = model_and_optimizer(kind)
    train(straight, straight_optimizers, batches)
    model, optimizers = model_and_optimizer(kind)
    train(model, optimizers, batches[:2])
    optimizer = optimizers.optimizers[0]
    model_state, optimizer_state = copy.deepcopy(get_state_dict(model, optimizer))
    resumed, resumed_optimizers = model_and_optimizer(kind)
    resumed_optimizer = resumed_optimizers.optimizers[0]
    set_state_dict(
        resumed, resumed_optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state
    )
    assert settings(resumed_optimizer) == settings(optimizer)  # SophiaG's B_h among them
    train(resumed, resumed_optimizers, batches[2:], first_step=3)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


class NotHidden(nn.Module):
    """What a matrix kind leaves to AdamW: an embedding (decayed) and a norm gain (not)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(5, 3)
        self.gain = nn.Parameter(torch.randn(7))


@pytest.mark.parametrize("kind", MATRIX_KINDS)
def test_the_adamw_side_is_torch_adamw(kind):
    torch.manual_seed(0)
    ours = NotHidden()
    theirs = copy.deepcopy(ours)
    cfg = config(kind)
    optimizers = Optimizers([ours], cfg, lr=1e-2)
    reference = torch.optim.AdamW(
        [
            {"params": [theirs.embedding.weight], "weight_decay": cfg.weight_decay},
            {"params": [theirs.gain], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=cfg.betas,
        eps=cfg.eps,
        foreach=False,
    )
    for _ in range(4):
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        optimizers.step()
        reference.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
        assert set(optimizers.optimizers[0].state[a]) == set(reference.state[b])


def every_kind_under_fsdp(rank, world_size):
    """For each kind, the max gap between an FSDP2-sharded model (each rank its own slice of the
    batch) and the same model stepped in this process on the whole batch, after 3 steps."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    gaps = {}
    for kind in KINDS:
        model, reference = sharded_and_whole(mesh)
        optimizers = [Optimizers([m], OptimConfig(kind=kind), lr=LR) for m in (model, reference)]
        torch.manual_seed(1)
        for _ in range(3):
            backward_on_shares(model, reference, rank, world_size)
            for each in optimizers:
                each.step()
                each.zero_grad()
        gaps[kind] = max(
            (p.full_tensor() - r).abs().max().item()
            for p, r in zip(model.parameters(), reference.parameters(), strict=True)
        )
    return gaps


def test_fsdp_sharded_steps_equal_one_process_for_every_kind():
    for gaps in run_distributed(every_kind_under_fsdp, 2, timeout_s=120):
        assert list(gaps) == list(KINDS)
        assert all(gap < 1e-6 for gap in gaps.values()), gaps
