import pytest
import torch

from goodput.config import load_config
from goodput.errors import GoodputError
from goodput.testing.tiny import TINY_MODEL
from goodput.train.config.optim import OptimConfig
from goodput.train.model import Transformer
from goodput.train.optim.optimizers import Optimizers


def test_norm_gains_are_not_decayed_and_a_step_moves_weights():
    model = Transformer(TINY_MODEL)
    optimizer = Optimizers([model], OptimConfig(weight_decay=0.1), lr=1e-2)
    decayed, undecayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and undecayed["weight_decay"] == 0.0
    assert all(p.ndim == 1 for p in undecayed["params"]) and len(undecayed["params"]) == 5
    before = model.output.weight.detach().clone()
    model(torch.randint(0, 61, (2, 8))).sum().backward()
    optimizer.step()
    assert not torch.equal(before, model.output.weight)


def test_optimizer_config_from_toml(tmp_path):
    path = tmp_path / "optim.toml"
    path.write_text("betas = [0.9, 0.99]\n")
    assert load_config(OptimConfig, path).betas == (0.9, 0.99)
    path.write_text('kind = "sgd"\n')
    with pytest.raises(GoodputError, match="'kind' = 'sgd' is not allowed; use one of 'adamw'"):
        load_config(OptimConfig, path)


def test_one_optimizer_per_part_stepped_and_its_lr_set_together():
    parts = [Transformer(TINY_MODEL), Transformer(TINY_MODEL)]
    optimizers = Optimizers(parts, OptimConfig(), lr=1e-2)
    assert len(optimizers.optimizers) == 2 and len(optimizers.param_groups) == 4
    for group in optimizers.param_groups:
        group["lr"] = 0.5
    assert all(g["lr"] == 0.5 for o in optimizers.optimizers for g in o.param_groups)
    before = [part.output.weight.detach().clone() for part in parts]
    for part in parts:
        part(torch.randint(0, 61, (2, 8))).sum().backward()
    optimizers.step()
    optimizers.zero_grad()
    for part, weight in zip(parts, before, strict=True):
        assert not torch.equal(weight, part.output.weight) and part.output.weight.grad is None
