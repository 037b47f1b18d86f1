"""The run config: derivation of the batch plan, clear errors for configs that cannot run, a
resolved config that reads back to the same thing, and a run directory that is ours."""

import dataclasses
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest

from goodput.config import from_table, load_config, load_section, to_toml
from goodput.errors import GoodputError
from goodput.rundir import CONFIG, METRICS
from goodput.testing.jobs import outside_any_job
from goodput.testing.tiny import tiny_run_config
from goodput.train.build import require_run_dir
from goodput.train.config.model import ModelConfig
from goodput.train.config.parallel import ParallelConfig
from goodput.train.config.run import RunConfig, TrainConfig, plan_batches

CONFIGS = Path(__file__).parents[4] / "configs"


def goodput_train(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "goodput", "train", str(CONFIGS / "tiny-cpu.toml"), *overrides],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("goodput: error: "), result.stderr
    return lines[0]


def train_config(**changes):
    fields = dict(steps=1, tokens_per_step=4096, seq_len=128, micro_batch_size=4, run_dir="run")
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
        ("train.micro_batch_size=0", "'train.micro_batch_size' = 0 is not in"),
        ("model.dim=-128", "'model.dim' = -128 is not in [1, 1048576]"),
        ("model.num_layers=0", "'model.num_layers' = 0 is not in"),
        ("model.vocab_size=nan", "'model.vocab_size' must be int, got nan"),
        ("schedule.lr=nan", "'schedule.lr' = nan is not in (0, 2**53]"),
        ("schedule.lr=-3e-4", "'schedule.lr' = -0.0003 is not in"),
        ("train.seq_len=512", "seq_len 512 exceeds model.max_seq_len 256"),
        ("train.stesp=5", "unknown key 'train.stesp'"),
        ("model.num_heads=3", "dim 128 is not divisible by num_heads 3"),
        ("parallel.data_parallel=replicate", "precision 'fp32-master' needs data_parallel"),
        ("optim.kind=sgd", "'optim.kind' = 'sgd' is not allowed"),
        ("parallel.tp=3", "tp = 3 does not divide model.num_heads = 4"),
        # Found at start, once the world size is known:
        ("train.micro_batch_size=3", "does not split into micro-batches of 3"),
        ("parallel.dp_shard=2", "= 2 ranks, but the world has 1; e.g. dp_replicate = 1, dp_sh"),
    ],
)
def test_goodput_train_refuses_a_bad_config_in_one_line(tmp_path, override, message):
    overrides = [override]
    if override.startswith("parallel."):
        overrides.append("parallel.precision=fp32-master")
    result = goodput_train(tmp_path, *overrides, f"train.run_dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    line = one_line_error(result)
    assert message in line
    assert "tiny-cpu.toml" in line or override in AT_START
    assert not (tmp_path / "run").exists()


AT_START = ("train.micro_batch_size=3", "parallel.dp_shard=2")


def number_keys(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """The dotted key and type of every number field of a config class, nested ones included."""
    keys = []
    for field in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[field.name]
        options = [o for o in typing.get_args(hint) if o is not type(None)] or [hint]
        for option in options:
            if dataclasses.is_dataclass(option):
                keys += number_keys(option, f"{prefix}{field.name}.")
            elif option in (int, float) or typing.get_origin(option) is tuple:
                keys.append((f"{prefix}{field.name}", option))
    return keys


@pytest.mark.parametrize(("key", "hint"), number_keys(RunConfig), ids=lambda k: str(k))
def test_every_number_of_the_run_config_refuses_nan_and_negatives(key, hint):
    """Class-level: no number field anywhere in the run config, present or future, takes NaN,
    -inf or a negative value; the error names the key."""
    bad = ("nan", "-inf", "-1", "-1.5") if hint is not int else ("nan", "-1", "1.5")
    for text in bad:
        value = f"[{text}, {text}]" if typing.get_origin(hint) is tuple else text
        with pytest.raises(GoodputError) as error:
            load_config(RunConfig, CONFIGS / "tiny-cpu.toml", [f"{key}={value}"])
        assert f"'{key}" in error.value.render() and error.value.code == 2


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.ffn_dim=9007199254740993", "'model.ffn_dim' = 9007199254740993 is not in"),
        ("model.vocab_size=100000000", "is not in [1, 16777216]"),
        ("model.norm_eps=inf", "'model.norm_eps' = inf is not in"),
        ("model.moe.top_k=0", "'model.moe.top_k' = 0 is not in"),
        ("optim.betas=[0.9, 1.0]", "'optim.betas[1]' = 1.0 is not in [0, 1)"),
        ("optim.betas=[0.9]", "'optim.betas' must be a list of 2"),
        ("schedule.min_lr_ratio=1.5", "'schedule.min_lr_ratio' = 1.5 is not in"),
        ("checkpoint.keep_last=0", "'checkpoint.keep_last' = 0 is not in"),
        ("checkpoint.resume=''", "'checkpoint.resume' is empty"),
        ("data.cache=' '", "'data.cache' is empty"),
        ("train.steps=true", "'train.steps' must be int, got True"),
        ("train.steps=8\nmodel.dim=1", "'train.steps' must be int"),  # one value per override
    ],
)
def test_out_of_range_values_name_their_key(override, message):
    with pytest.raises(GoodputError, match="tiny-cpu.toml") as error:
        load_config(RunConfig, CONFIGS / "tiny-cpu.toml", [override])
    assert message in error.value.render()


def test_inf_turns_clipping_off_and_nothing_else():
    cfg = load_config(RunConfig, CONFIGS / "tiny-cpu.toml", ["train.max_grad_norm=inf"])
    assert cfg.train.max_grad_norm == float("inf")
    with pytest.raises(GoodputError, match="'train.max_grad_norm' = -inf is not in"):
        load_config(RunConfig, CONFIGS / "tiny-cpu.toml", ["train.max_grad_norm=-inf"])


def test_an_empty_output_is_refused_and_the_working_directory_untouched(tmp_path):
    (tmp_path / "config.toml").write_text("mine\n")
    result = goodput_train(tmp_path, "train.run_dir=")
    assert result.returncode == 2
    assert "'train.run_dir' is empty" in one_line_error(result)
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]
    assert (tmp_path / "config.toml").read_text() == "mine\n"


def test_a_foreign_folder_is_refused_as_run_directory_and_left_untouched(tmp_path):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "config.toml").write_text("mine\n")
    (foreign / "notes").mkdir()
    result = goodput_train(tmp_path, f"train.run_dir={foreign}")
    assert result.returncode == 2
    line = one_line_error(result)
    assert "is not a goodput run directory (no run.json) and not empty" in line
    assert "'config.toml' and 1 more" in line
    assert sorted(p.name for p in foreign.iterdir()) == ["config.toml", "notes"]
    assert (foreign / "config.toml").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # no blend cache either


def test_a_run_directory_is_new_empty_a_run_or_holds_only_launcher_files(tmp_path):
    require_run_dir(tmp_path / "new")
    require_run_dir(tmp_path)  # empty
    launcher_files = ("chain.sbatch", "j-42.out", "train.log", "hostfile-0123456789ab")
    for name in (*launcher_files, "attempts.jsonl"):
        (tmp_path / name).write_text("")
    require_run_dir(tmp_path)  # what goodput submit and launch write before the trainer
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(GoodputError, match="holds 'metrics.jsonl'"):
        require_run_dir(tmp_path)
    (tmp_path / "run.json").write_text("{}")
    require_run_dir(tmp_path)  # a goodput run directory: resumed or extended
    with pytest.raises(GoodputError, match="is a file where a folder should be"):
        require_run_dir(tmp_path / "run.json")
    with pytest.raises(GoodputError, match="lies in the run directory"):
        require_run_dir(tmp_path / "nested")  # a run inside a run would mix their files


def test_a_missing_table_is_named(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text((CONFIGS / "tiny-cpu.toml").read_text().replace("[data]", "[dta]"))
    with pytest.raises(GoodputError, match="unknown key 'dta'"):
        load_config(RunConfig, path)


def test_resolved_config_reads_back_equal():
    cfg = load_config(RunConfig, CONFIGS / "tiny-cpu.toml", ["train.max_grad_norm=inf"])
    assert from_table(RunConfig, tomllib.loads(to_toml(cfg)), "resolved") == cfg


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_model_table_round_trips(path):
    model = load_section(ModelConfig, path, "model")
    assert from_table(ModelConfig, tomllib.loads(to_toml(model)), "resolved") == model


def test_replicate_runs_fp32_or_pure_bf16_only():
    assert ParallelConfig(data_parallel="replicate", precision="fp32")
    with pytest.raises(GoodputError, match="needs data_parallel = 'fsdp'"):
        ParallelConfig(data_parallel="replicate")


@pytest.mark.parametrize(
    ("key", "value", "written"),
    [("activation_checkpointing", "full", '"full"'), ("compile", True, "true")],
)
def test_deprecated_train_keys_move_to_parallel_with_one_warning_line(key, value, written, capsys):
    cfg = load_config(RunConfig, CONFIGS / "tiny-cpu.toml", [f"train.{key}=true"])
    assert getattr(cfg.parallel, key) == value and getattr(cfg.train, key) is None
    warning = capsys.readouterr().err.strip().splitlines()
    assert warning == [
        f"goodput: warning: [train] {key} is deprecated; set it in [parallel] (the [train] key "
        "is read until the next release)"
    ]
    resolved = to_toml(cfg)
    assert f"[train]\n{key}" not in resolved and f"\n{key} = {written}" in resolved  # [parallel]
    assert from_table(RunConfig, tomllib.loads(resolved), "resolved") == cfg
    assert not capsys.readouterr().err  # the resolved config warns no more
    assert load_config(RunConfig, CONFIGS / "tiny-cpu.toml", [f"parallel.{key}={written}"]) == cfg
    with pytest.raises(GoodputError, match=f"{key} is set in both .train. and .parallel."):
        load_config(
            RunConfig, CONFIGS / "tiny-cpu.toml", [f"train.{key}=false", f"parallel.{key}=true"]
        )


@pytest.mark.parametrize(("old", "new"), [(True, "full"), (False, "none")])
def test_a_boolean_activation_checkpointing_is_read_as_its_mode_with_one_line(old, new, capsys):
    written = "true" if old else "false"
    raw = tomllib.loads((CONFIGS / "tiny-cpu.toml").read_text())
    raw.setdefault("parallel", {})["activation_checkpointing"] = old  # a file of before
    from_file = from_table(RunConfig, raw, "old.toml")
    overridden = load_config(
        RunConfig, CONFIGS / "tiny-cpu.toml", [f"parallel.activation_checkpointing={written}"]
    )
    for cfg in (from_file, overridden):
        assert cfg.parallel.activation_checkpointing == new
    line = (
        f"goodput: warning: parallel.activation_checkpointing = {written} is deprecated; use "
        f'parallel.activation_checkpointing = "{new}"'
    )
    assert capsys.readouterr().err.splitlines() == [line, line]
    # Only a boolean is an old spelling: 1 is neither a mode nor true.
    with pytest.raises(GoodputError, match="activation_checkpointing"):
        load_config(RunConfig, CONFIGS / "tiny-cpu.toml", ["parallel.activation_checkpointing=1"])


def test_per_op_checkpointing_is_refused_with_split_experts():
    with pytest.raises(GoodputError, match="'op' with ep = 2.*torchtitan#3427"):
        ParallelConfig(activation_checkpointing="op", ep=2)
    assert ParallelConfig(activation_checkpointing="full", ep=2).ep == 2


def test_a_memory_budget_needs_its_mode_and_compile():
    with pytest.raises(GoodputError, match="'budget' needs compile = true"):
        ParallelConfig(activation_checkpointing="budget")
    with pytest.raises(
        GoodputError, match="activation_memory_budget.*activation_checkpointing = 'budget'"
    ):
        load_config(RunConfig, CONFIGS / "tiny-cpu.toml", ["parallel.activation_memory_budget=0.3"])
    for budget in ("0", "1", "1.5"):
        with pytest.raises(GoodputError, match="activation_memory_budget"):
            load_config(
                RunConfig,
                CONFIGS / "tiny-cpu.toml",
                [
                    "parallel.activation_checkpointing=budget",
                    "parallel.compile=true",
                    f"parallel.activation_memory_budget={budget}",
                ],
            )


def test_deprecated_train_output_is_the_run_dir_with_one_warning_line(tmp_path, capsys):
    cfg = load_config(RunConfig, CONFIGS / "tiny-cpu.toml", [f"train.run_dir={tmp_path}"])
    assert not capsys.readouterr().err
    old = (CONFIGS / "tiny-cpu.toml").read_text().replace("\nrun_dir = ", "\noutput = ")
    (tmp_path / "old.toml").write_text(old)
    assert '\noutput = "demo/run"\n' in old
    (tmp_path / "own.toml").write_text(old.replace('"demo/run"', f'"{tmp_path}"'))
    warning = "goodput: warning: train.output is deprecated; use train.run_dir"
    for path, overrides, warnings in [
        (tmp_path / "own.toml", [], [warning]),  # the old TOML key
        (tmp_path / "old.toml", [f"train.output={tmp_path}"], [warning]),  # the old override
        # The command line wins over the file, whichever spelling each uses.
        (CONFIGS / "tiny-cpu.toml", [f"train.output={tmp_path}"], [warning]),
        (tmp_path / "old.toml", [f"train.run_dir={tmp_path}"], []),
        (tmp_path / "old.toml", ["train.output=elsewhere", f"train.run_dir={tmp_path}"], [warning]),
    ]:
        assert load_config(RunConfig, path, overrides) == cfg
        assert capsys.readouterr().err.splitlines() == warnings
    resolved = to_toml(cfg)
    assert "\noutput" not in resolved and from_table(RunConfig, tomllib.loads(resolved), "r") == cfg
    (tmp_path / "both.toml").write_text(old.replace("\noutput = ", '\nrun_dir = "x"\noutput = '))
    with pytest.raises(GoodputError, match="train.run_dir and train.output are both set, diff"):
        load_config(RunConfig, tmp_path / "both.toml")
    without = old.replace("\noutput = ", "\n# output = ")
    (tmp_path / "none.toml").write_text(without)
    with pytest.raises(GoodputError, match=r"\[train\] run_dir is not set; add train.run_dir="):
        load_config(RunConfig, tmp_path / "none.toml")


def test_goodput_train_puts_the_run_where_train_output_on_the_command_line_says(tmp_path):
    """The deprecated override over a config that sets run_dir: the command line wins, with one
    warning line, through the real command (one step of the tiny run)."""
    config = tmp_path / "tiny.toml"
    config.write_text(to_toml(tiny_run_config(tmp_path)))
    assert f'run_dir = "{tmp_path / "run"}"' in config.read_text()
    result = subprocess.run(
        [sys.executable, "-m", "goodput", "train", str(config), "train.steps=1"]
        + [f"train.output={tmp_path / 'moved'}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=outside_any_job(OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr
    assert (
        result.stderr.splitlines().count(
            "goodput: warning: train.output is deprecated; use train.run_dir"
        )
        == 1
    )
    assert (tmp_path / "moved" / CONFIG).is_file() and (tmp_path / "moved" / METRICS).is_file()
    assert not (tmp_path / "run").exists()
