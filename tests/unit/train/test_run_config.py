"""The run config: derivation of the batch plan, clear errors for configs that cannot run, and a
resolved config that reads back to the same thing."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from goodput.config import build, load_config, load_section, to_toml
from goodput.errors import GoodputError
from goodput.train.config import RunConfig, TrainConfig, plan_batches
from goodput.train.model import ModelConfig
from goodput.train.parallelize import ParallelConfig

CONFIGS = Path(__file__).parents[3] / "configs"


def train_config(**changes):
    fields = dict(steps=1, tokens_per_step=4096, seq_len=128, micro_batch_size=4, output="run")
    return TrainConfig(**{**fields, **changes})


def test_accumulation_is_derived_from_tokens_micro_batch_and_dp():
    plan = plan_batches(train_config(), dp_size=2)
    assert (plan.global_batch_size, plan.grad_accumulation, plan.local_batch_size) == (32, 4, 16)
    assert plan_batches(train_config(), dp_size=8).grad_accumulation == 1


def test_a_batch_that_does_not_divide_names_the_numbers_and_a_value_that_works():
    with pytest.raises(GoodputError) as error:
        plan_batches(train_config(), dp_size=3)
    message = error.value.render()
    assert "32 samples" in message and "micro-batches of 4 on 3 data-parallel ranks" in message
    suggested = int(message.split("e.g. ")[1].split(",")[0])
    assert plan_batches(train_config(tokens_per_step=suggested), dp_size=3).grad_accumulation == 3
    with pytest.raises(GoodputError, match="not a multiple of seq_len 128"):
        train_config(tokens_per_step=4000)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.tokens_per_step=1000", "tokens_per_step 1000 is not a multiple of seq_len 128"),
        ("train.micro_batch_size=0", "micro_batch_size = 0 must be >= 1"),
        ("train.seq_len=512", "seq_len 512 exceeds model.max_seq_len 256"),
        ("train.stesp=5", "unknown key 'train.stesp'"),
        ("model.num_heads=3", "dim 128 is not divisible by num_heads 3"),
        ("parallel.data_parallel=replicate", "precision 'fp32-master' needs data_parallel"),
        ("optim.kind=sgd", "'optim.kind' = 'sgd' is not allowed"),
        ("train.micro_batch_size=3", "does not split into micro-batches of 3"),  # at start
    ],
)
def test_goodput_train_refuses_a_bad_config_in_one_line(tmp_path, override, message):
    overrides = [override]
    if override.startswith("parallel."):
        overrides.append("parallel.precision=fp32-master")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "goodput",
            "train",
            str(CONFIGS / "tiny-cpu.toml"),
            *overrides,
            f"train.output={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert "tiny-cpu.toml" in lines[0] or override == "train.micro_batch_size=3"
    assert not (tmp_path / "run").exists()


def test_a_missing_table_is_named(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text((CONFIGS / "tiny-cpu.toml").read_text().replace("[data]", "[dta]"))
    with pytest.raises(GoodputError, match="unknown key 'dta'"):
        load_config(RunConfig, path)


def test_resolved_config_reads_back_equal():
    cfg = load_config(RunConfig, CONFIGS / "tiny-cpu.toml", ["train.max_grad_norm=inf"])
    assert build(RunConfig, tomllib.loads(to_toml(cfg)), "resolved") == cfg


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_model_table_round_trips(path):
    model = load_section(ModelConfig, path, "model")
    assert build(ModelConfig, tomllib.loads(to_toml(model)), "resolved") == model


def test_replicate_runs_fp32_or_pure_bf16_only():
    assert ParallelConfig(data_parallel="replicate", precision="fp32")
    with pytest.raises(GoodputError, match="needs data_parallel = 'fsdp'"):
        ParallelConfig(data_parallel="replicate")
