"""The logged loss and the gradients are the same for any DP size and grad-accumulation split,
even when micro-batches hold very different numbers of target tokens."""

import math
from dataclasses import replace

import pytest
import torch

from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL, rank_micro_batches, uneven_global_batch
from goodput.train.config.model import MoEConfig
from goodput.train.config.schedule import ScheduleConfig, learning_rate
from goodput.train.loss import IGNORE_INDEX, num_targets, token_loss_sum
from goodput.train.model import Transformer
from goodput.train.step import StepSettings, clip_and_step, forward_backward, train_step

NO_CLIP = StepSettings(max_grad_norm=None)

GLOBAL_BATCH = 8


def one_step(rank, world_size, accumulation):
    torch.manual_seed(0)
    model = Transformer(TINY_MODEL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = rank_micro_batches(*uneven_global_batch(), rank, world_size, accumulation)
    result = train_step(model, optimizer, micro, NO_CLIP)
    return result.loss, result.grad_norm, result.num_tokens, model.output.weight[:3, :3].clone()


@pytest.fixture(scope="module")
def reference():
    return one_step(0, 1, 1)


def test_fresh_loss_is_the_global_token_mean(reference):
    loss, _, num_tokens, _ = reference
    assert num_tokens == sum(range(1, GLOBAL_BATCH + 1))
    assert abs(loss - math.log(61)) < 0.2


@pytest.mark.parametrize(("world_size", "accumulation"), [(1, 8), (1, 2), (2, 1), (2, 4), (4, 2)])
def test_same_loss_and_update_for_any_split(reference, world_size, accumulation):
    if world_size == 1:
        results = [one_step(0, 1, accumulation)]
    else:
        results = run_distributed(one_step, world_size, accumulation)
    for loss, grad_norm, num_tokens, weights in results:
        assert num_tokens == reference[2]
        assert loss == pytest.approx(reference[0], rel=1e-5)
        assert grad_norm == pytest.approx(reference[1], rel=1e-4)
        assert torch.allclose(weights, reference[3], atol=1e-6)


def test_the_loss_alone_is_the_step_loss_and_the_step_is_its_two_halves(reference):
    torch.manual_seed(0)
    model = Transformer(TINY_MODEL)
    inputs, labels = uneven_global_batch()
    with torch.no_grad():  # as evaluation uses it
        loss = token_loss_sum(model(inputs), labels).item() / num_targets(labels)
    assert loss == reference[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = rank_micro_batches(inputs, labels, 0, 1, accumulation=2)
    result = forward_backward(model, micro)
    grad_norm = clip_and_step([model], optimizer, max_grad_norm=None)
    assert result.loss_sum / result.num_tokens == pytest.approx(reference[0], rel=1e-6)
    assert (result.num_tokens, result.expert_load) == (36, None)  # a dense model
    assert grad_norm == pytest.approx(reference[1], rel=1e-5)
    assert all(p.grad is None for p in model.parameters())  # zeroed for the next step


def test_per_micro_batch_mean_would_differ(reference):
    # The silent failure this step avoids: averaging micro-batch means weighs rows, not tokens.
    torch.manual_seed(0)
    model = Transformer(TINY_MODEL)
    inputs, labels = uneven_global_batch()
    means = [
        torch.nn.functional.cross_entropy(
            model(inputs[i : i + 1]).flatten(0, 1), labels[i].flatten(), ignore_index=IGNORE_INDEX
        )
        for i in range(GLOBAL_BATCH)
    ]
    assert abs(torch.stack(means).mean().item() - reference[0]) > 1e-3


def test_schedules():
    cosine = ScheduleConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert learning_rate(cosine, 0, 100) == pytest.approx(0.1)
    assert learning_rate(cosine, 9, 100) == pytest.approx(1.0)
    assert learning_rate(cosine, 100, 100) == pytest.approx(0.1)
    wsd = ScheduleConfig(kind="wsd", lr=1.0, warmup_steps=10, min_lr_ratio=0.0, decay_fraction=0.2)
    assert learning_rate(wsd, 50, 100) == 1.0 and learning_rate(wsd, 79, 100) == 1.0
    assert learning_rate(wsd, 90, 100) == pytest.approx(0.5)


MOE_MODEL = replace(
    TINY_MODEL,
    moe=MoEConfig(
        num_experts=4, top_k=1, expert_ffn_dim=16, aux_loss_coef=1.0, bias_update_rate=0.1
    ),
)


def moe_step(rank, world_size):
    torch.manual_seed(0)
    model = Transformer(MOE_MODEL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, labels = uneven_global_batch()
    with torch.no_grad():
        token_losses = torch.nn.functional.cross_entropy(
            model(inputs).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
        )
    micro = rank_micro_batches(inputs, labels, rank, world_size, accumulation=2)
    result = train_step(model, optimizer, micro, NO_CLIP)
    biases = [layer.selection_bias.clone() for layer in model.moe_layers()]
    return result.loss, token_losses.item(), biases


def test_moe_reports_the_language_loss_and_moves_router_bias_on_the_global_load():
    loss, language_loss, biases = moe_step(0, 1)
    assert loss == pytest.approx(language_loss, rel=1e-5)  # the aux loss (coef 1) is left out
    assert any(bias.abs().sum() > 0 for bias in biases)
    for rank_loss, _, rank_biases in run_distributed(moe_step, 2):
        assert rank_loss == pytest.approx(loss, rel=1e-5)
        for rank_bias, bias in zip(rank_biases, biases, strict=True):
            assert torch.equal(rank_bias, bias)  # every rank, and the same as one process
