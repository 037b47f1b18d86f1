"""The [optim] and [diagnostics] tables as a user writes them: every kind and key through the
real CLI parser, and the combinations that cannot work refused in one line before anything
runs."""

import pytest

from goodput import cli
from goodput.config import load_config, to_toml
from goodput.errors import GoodputError
from goodput.testing.tiny import tiny_run_config
from goodput.train.config.optim import OptimConfig
from goodput.train.config.run import RunConfig


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(to_toml(tiny_run_config(tmp_path)))
    return path


@pytest.mark.parametrize(
    "overrides",
    [
        ["optim.kind=lamb", "optim.lamb_max_weight_norm=5.0"],
        ["optim.kind=sophiag", "optim.sophia_rho=0.05", "optim.sophia_hessian_interval=5"],
        ["optim.kind=muon", "optim.muon_lr_rule=spectral", "optim.nesterov=true"],
        ["optim.kind=mano", "optim.momentum=0.9", "optim.qk_clip=100.0"],
        ["optim.lr_scaling=sqrt", "optim.lr_reference_tokens=4096"],
        ["diagnostics.freeze_check_interval=0", "diagnostics.loss_spike_z=4.0"],
    ],
)
def test_each_kind_and_key_loads(config_file, overrides):
    cfg = load_config(RunConfig, config_file, overrides)
    for item in overrides:
        section, rest = item.split(".", 1)
        key, value = rest.split("=", 1)
        assert str(getattr(getattr(cfg, section), key)).lower() == value.lower()


@pytest.mark.parametrize(
    ("overrides", "phrase"),
    [
        (["optim.kind=adam"], "optim"),
        (["optim.qk_clip=100.0", "parallel.cp=2"], "qk_clip"),
        (["optim.lr_reference_tokens=4096"], "lr_scaling"),
        (["optim.momentum=1.0"], "momentum"),
        (["optim.sophia_hessian_interval=0"], "sophia_hessian_interval"),
        (["optim.muon_lr_rule=adamw"], "muon_lr_rule"),
        (["diagnostics.freeze_threshold=1.5"], "freeze_threshold"),
        (["diagnostics.loss_spike_window=2"], "loss_spike_window"),
    ],
)
def test_a_config_that_cannot_work_is_one_line_naming_the_key(
    config_file, capsys, overrides, phrase
):
    assert cli.main(["diagnose", "lr-find", str(config_file), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("goodput: error: ") and phrase in err


def test_the_lr_multiplier_follows_the_rule():
    assert OptimConfig().lr_multiplier(8192, 4096) == 1.0
    assert OptimConfig(lr_scaling="linear").lr_multiplier(8192, 4096) == 2.0
    assert OptimConfig(lr_scaling="sqrt").lr_multiplier(8192, 4096) == pytest.approx(2**0.5)
    pinned = OptimConfig(lr_scaling="sqrt", lr_reference_tokens=2048)
    assert pinned.lr_multiplier(8192, 4096) == pytest.approx(2.0)  # the pinned reference wins
    with pytest.raises(GoodputError, match="lr_reference_tokens is set but lr_scaling is none"):
        OptimConfig(lr_reference_tokens=4096)
