"""Every shipped config parses; sizes computed from configs match real modules."""

import json
from pathlib import Path

import pytest
import torch

from goodput import cli
from goodput.config import load_section
from goodput.errors import GoodputError
from goodput.train.config.model import ModelConfig
from goodput.train.flops import flops_per_token, model_size
from goodput.train.model import Transformer

CONFIGS = sorted((Path(__file__).parents[4] / "configs").glob("*.toml"))


def test_the_named_configs_are_all_shipped():
    names = {path.stem for path in CONFIGS}
    assert {
        "tiny-cpu",
        "llama-2b",
        "llama-8b",
        "llama-20b",
        "llama-80b",
        "llama-405b",
        "moe-small",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_parses_and_describes(path, capsys):
    cfg = load_section(ModelConfig, path, "model")
    assert model_size(cfg).total >= model_size(cfg).active > 0
    assert cli.main(["model", "info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters_total"] == model_size(cfg).total


@pytest.mark.parametrize("name", ["tiny-cpu", "moe-small"])
def test_counts_match_real_modules(name):
    cfg = load_section(ModelConfig, Path(__file__).parents[4] / f"configs/{name}.toml", "model")
    model = Transformer(cfg)
    assert model_size(cfg).total == sum(p.numel() for p in model.parameters())


def test_moe_active_count_and_untied_count_match_modules():
    cfg = load_section(
        ModelConfig,
        Path(__file__).parents[4] / "configs/moe-small.toml",
        "model",
        ["tie_embeddings=false"],
    )
    model = Transformer(cfg)
    size = model_size(cfg)
    assert size.total == sum(p.numel() for p in model.parameters())
    experts = model.moe_layers()[0].experts  # grouped weights: [experts, in, out] each
    expert = sum(p[0].numel() for p in experts.parameters())
    assert size.total - size.active == cfg.num_layers * (8 - 2) * expert


def test_llama3_8b_shape_has_its_published_size():
    cfg = load_section(ModelConfig, Path(__file__).parents[4] / "configs/llama-8b.toml", "model")
    assert model_size(cfg).total == 8_030_261_248
    # 6N without the 525M input table, plus 12 * 32 layers * 4096 * 8192.
    assert flops_per_token(cfg, 8192) == 6 * (8_030_261_248 - 128256 * 4096) + 12 * 32 * 4096 * 8192


def test_model_info_errors_name_the_file_and_key(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nvocab_size = 10\ndim = 30\nnum_layers = 1\nnum_heads = 4\n")
    assert cli.main(["model", "info", str(bad)]) == 2
    assert "dim 30 is not divisible by num_heads 4" in capsys.readouterr().err
    bad.write_text("[model]\nvocab_size = 10\ndim = 32\nnum_layers = 1\nnum_heads = 4\nheads = 2\n")
    assert cli.main(["model", "info", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "unknown key 'model.heads'" in err and "num_kv_heads" in err
    with pytest.raises(GoodputError, match=r"no \[train\] table"):
        load_section(ModelConfig, tmp_path / "bad.toml", "train")


def test_tiny_config_trains_a_step():
    cfg = load_section(ModelConfig, Path(__file__).parents[4] / "configs/tiny-cpu.toml", "model")
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33))
    loss = torch.nn.functional.cross_entropy(
        model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
    )
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
