import pytest
import torch

from goodput.config import load_config
from goodput.errors import GoodputError
from goodput.testing.tiny import TINY_MODEL
from goodput.train.model import Transformer
from goodput.train.optim import OptimConfig, build_optimizer


def test_norm_gains_are_not_decayed_and_a_step_moves_weights():
    model = Transformer(TINY_MODEL)
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1), lr=1e-2)
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
