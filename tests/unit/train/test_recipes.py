"""The shipped recipes (``configs/`` but the CPU demo): each is a complete run config for the
machine its ``# Machine:`` line names, from the source its ``# Source:`` line names, and only the
data is left to its user.

Each is held to the trainer's own start-up checks on that machine's world, without building
anything: the model's split (``ParallelConfig.check_model``, run by ``RunConfig``) and
``train.config.check_world`` (the degrees against the world size, tensor parallelism within a
host, the global batch over the data-parallel ranks, the pipeline's micro-batches).
What they need in memory is checked by ``goodput plan layout CONFIG --layout-from-config
--verify`` (docs/walkthrough.md, run by tests/docs/test_docs.py).
"""

import re
from pathlib import Path

import pytest

from goodput import cli
from goodput.config import load_config
from goodput.errors import GoodputError
from goodput.testing.jobs import REPO
from goodput.testing.recipes import RECIPES, recipe_machine
from goodput.train.config.parallel import resolve_degrees
from goodput.train.config.run import RunConfig, check_world

CONFIGS = REPO / "configs"
SOURCE = re.compile(r"^# Source: (.+)", re.M)
MISSING_DATA = (
    "goodput: error: configs/{name}.toml: [data] file_list is not set; "
    "add data.file_list=PATH (your corpora, see docs/data.md) or add "
    'data.stages=[{{file_list="PATH", start_step=0}}, ...] (see docs/training.md)'
)


def machine(path: Path) -> tuple[int, int]:
    """(nodes, devices per node) of the recipe's ``# Machine:`` line."""
    found = recipe_machine(path)
    return found.nhosts, found.ppn


def load(path: Path, *overrides: str) -> RunConfig:
    return load_config(RunConfig, path, ["data.file_list=corpora.txt", *overrides])


def test_every_size_ships_as_a_recipe():
    names = {path.stem for path in RECIPES}
    expected = {"llama-2b", "llama-8b", "llama-20b", "llama-70b", "llama-80b", "llama-405b"}
    assert expected | {"moe-small"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_names_its_machine_and_source(path):
    machine(path)
    source = SOURCE.search(path.read_text())
    assert source and len(source[1]) > 20, f"{path.name}: no '# Source: ...' line"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_starts_on_its_machine(path):
    cfg = load(path)  # RunConfig checks the layout against the model and seq_len
    nodes, per_node = machine(path)
    world = nodes * per_node
    degrees = resolve_degrees(cfg.parallel, world)
    assert degrees.product() == world
    # Every degree is the recipe's own: none is left for the world size to fill.
    for name in ("dp_shard", "tp", "pp", "cp"):
        assert getattr(degrees, name) == (getattr(cfg.parallel, name) or 1)
    plan = check_world(cfg, world, per_node)  # tp within a host, the batch, the pipeline
    assert plan.dp_size == degrees.dp
    assert cfg.train.run_dir == f"runs/{path.stem}"
    assert cfg.checkpoint.interval_steps or cfg.checkpoint.interval_minutes


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_refuses_another_machine(path):
    """Its degrees are pinned: one node less is refused at start, naming the world size."""
    cfg = load(path)
    nodes, per_node = machine(path)
    other = (nodes - 1 or 2) * per_node
    with pytest.raises(GoodputError, match=f"but the world has {other}"):
        resolve_degrees(cfg.parallel, other)


def test_a_pipeline_with_fewer_micro_batches_than_stages_is_refused_without_torch():
    """The 405B's 32 micro-batches a pipeline at 16M tokens; a quarter of the batch leaves 8,
    fewer than its 16 stages, which 1F1B refuses: ``check_world`` (what ``goodput submit``
    runs on a chain's config) says so before any job starts."""
    path = CONFIGS / "llama-405b.toml"
    nodes, per_node = machine(path)
    check_world(load(path), nodes * per_node, per_node)
    quarter = load(path, f"train.tokens_per_step={2048 * 8192 // 4}")
    with pytest.raises(GoodputError, match="with 8 micro-batches on pp = 16: it needs at least"):
        check_world(quarter, nodes * per_node, per_node)


def test_the_published_layouts_are_the_sources():
    """The numbers the sources publish, as the recipes hold them (the comments cite each)."""
    layouts = {}
    for name in ("llama-8b", "llama-70b", "llama-405b", "llama-80b", "llama-20b", "llama-2b"):
        cfg = load(CONFIGS / f"{name}.toml")
        parallel, samples = cfg.parallel, cfg.train.tokens_per_step // cfg.train.seq_len
        layouts[name] = (parallel.dp_replicate or 1, parallel.dp_shard, parallel.tp, parallel.pp)
        layouts[name] += (cfg.train.seq_len, samples)
    assert layouts == {
        "llama-8b": (1, 8, 1, 1, 8192, 8),  # torchtitan: FSDP 8, local batch 1
        "llama-70b": (1, 32, 8, 1, 8192, 512),  # torchtitan: FSDP 32 x TP 8, global batch 512
        "llama-405b": (1, 64, 8, 16, 8192, 2048),  # Meta: TP 8 x PP 16 x DP 64, 16M tokens
        "llama-80b": (1, 372, 4, 1, 8192, 372),  # the seed: TP 4, LBS 1, GBS 372
        "llama-20b": (1, 6144, 1, 1, 8192, 6144),  # the seed: FSDP on 512 nodes
        "llama-2b": (256, 12, 1, 1, 8192, 6144),  # AuroraGPT-2B: GBS 6144 on 256 nodes
    }
    layers = load(CONFIGS / "llama-405b.toml").parallel.pp_layers_per_stage
    assert layers == (7, *[8] * 14, 7)  # Meta: one layer less on the first and last stage


def test_the_published_expert_layouts_are_the_sources():
    """The mixtures of experts' sources' layouts (each recipe's comments cite them)."""
    layouts = {}
    for name in ("mixtral-8x7b", "deepseek-v3"):
        parallel = load(CONFIGS / f"{name}.toml").parallel
        layouts[name] = (parallel.dp_shard, parallel.tp, parallel.pp, parallel.ep)
        layouts[name] += (parallel.pp_schedule,)
    assert layouts == {
        "mixtral-8x7b": (16, 1, 4, 8, "1f1b"),  # Megatron-Core: TP1 EP8 PP4 on 64 GPUs
        "deepseek-v3": (128, 1, 16, 64, "dualpipev"),  # PP16 (DualPipe) x EP64 x DP on 2,048
    }


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_goodput_train_without_data_names_the_override(path, capsys, monkeypatch):
    monkeypatch.chdir(CONFIGS.parent)
    assert cli.main(["train", f"configs/{path.name}"]) == 2
    assert capsys.readouterr().err.strip() == MISSING_DATA.format(name=path.stem)


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ("", [], "[data] file_list is not set; add data.file_list=PATH"),  # no [data] at all
        ("[data]\n", [], "[data] file_list is not set; add data.file_list=PATH"),
        ("[data]\ncache = 'c'\n", [], "[data] file_list is not set; add data.file_list=PATH"),
        ("", ["data.file_list="], "'data.file_list' is empty"),
        ("", ["data.file_list=' '"], "'data.file_list' is empty"),
        ("", ["data.file_list=3"], "'data.file_list' must be str, got 3"),
        ("", ["data.file_list=[1]"], "'data.file_list' must be str, got [1]"),
        ("", ['data.file_list="a\\u0000b"'], "must be text without NUL bytes"),
        ("", ["data=3"], "'data' must be a table, got 3"),
        ("", ["data.files=a"], "unknown key 'data.files'"),
    ],
)
def test_a_bad_or_missing_file_list_is_one_usage_error(tmp_path, text, overrides, message):
    recipe = (CONFIGS / "llama-8b.toml").read_text().replace("[data]\n", "[unused]\n")
    recipe = recipe.replace("[unused]\ncache", "# cache")  # the recipe's [data] table, gone
    path = tmp_path / "run.toml"
    path.write_text(recipe + "\n" + text)
    with pytest.raises(GoodputError) as error:
        load_config(RunConfig, path, overrides)
    assert error.value.code == 2 and message in error.value.render()
    assert "\n" not in error.value.render()


def test_a_missing_train_table_names_its_first_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nvocab_size = 8\ndim = 8\nnum_layers = 1\nnum_heads = 1\n")
    with pytest.raises(GoodputError, match=r"\[train\] steps is not set; add train.steps=VALUE"):
        load_config(RunConfig, path)
