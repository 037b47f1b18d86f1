"""`goodput ckpt import --from megatron|megatron-legacy|deepspeed`: checkpoints Megatron-core
writes itself (``goodput.testing.megatron_source``, in processes of its own) come in with the
logits Megatron's own forward gives, from TP 2 x PP 2, PP 2 and DeepSpeed sources; a run
resumed from one starts at Megatron's loss on the same batch; hostile and mismatched sources are
refused in one line."""

import io
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from goodput.cli import main
from goodput.config import load_config, load_section
from goodput.data.blend import build_blend
from goodput.data.loader import BlendedSamples
from goodput.errors import GoodputError
from goodput.launch.launchers import free_port
from goodput.testing import megatron_source
from goodput.testing.recipes import RECIPES
from goodput.testing.tiny import TINY_MODEL, write_random_corpus
from goodput.train.build import blend_spec
from goodput.train.config.model import ModelConfig
from goodput.train.config.run import RunConfig, plan_batches
from goodput.train.convert import checkpoints, megatron
from goodput.train.model import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
HARNESS = Path(megatron_source.__file__)
TOLERANCE = 1e-5  # relative to the largest logit: float32 rounding, as the issue asks
# GQA (4 query heads in 2 groups), SwiGLU, RoPE halves, untied head.
GQA_UNTIED = {
    "num_layers": 4,
    "hidden_size": 64,
    "ffn_hidden_size": 96,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "max_position_embeddings": 64,
    "rotary_base": 10000.0,
    "norm_epsilon": 1e-5,
    "vocab_size": 128,
    "tied": False,
}
# Multi-head attention, tied head, RoPE on interleaved pairs, another base and epsilon.
MHA_TIED = {
    **GQA_UNTIED,
    "num_query_groups": 4,
    "tied": True,
    "rotary_interleaved": True,
    "rotary_base": 500000.0,
    "norm_epsilon": 1e-6,
}


def harness(*argv: object) -> None:
    result = subprocess.run(
        [sys.executable, str(HARNESS), *map(str, argv), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


class Saved:
    """One Megatron save: its folders by format, the model config, and Megatron's logits."""

    def __init__(self, root: Path, spec: dict, tp: int, pp: int, formats: str):
        self.root, self.spec = root, spec
        (root / "spec.json").write_text(json.dumps(spec))
        harness(
            "save", root / "spec.json", root / "out", "--tp", tp, "--pp", pp, "--formats", formats
        )
        self.config = root / "model.toml"
        self.config.write_text(megatron_source.model_toml(spec))
        self.tokens = torch.randint(
            0, spec["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(5)
        )
        torch.save(self.tokens, root / "tokens.pt")
        self.truth = self.megatron_forward(self.tokens)["logits"]

    def folder(self, fmt: str) -> Path:
        return self.root / "out" / fmt

    def megatron_forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Megatron's forward at TP = PP = 1 on ``tokens``, its weights loaded by Megatron's
        own dist_checkpointing from this save's torch_dist folder."""
        torch.save(tokens, self.root / "batch.pt")
        harness(
            "logits",
            self.root / "spec.json",
            self.folder("torch_dist") / "iter_0000010",
            self.root / "batch.pt",
            self.root / "truth.pt",
        )
        return torch.load(self.root / "truth.pt", weights_only=True)


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory) -> Saved:
    return Saved(tmp_path_factory.mktemp("tp2pp2"), GQA_UNTIED, 2, 2, "torch_dist,legacy")


@pytest.fixture(scope="module")
def pp2_tied(tmp_path_factory) -> Saved:
    return Saved(tmp_path_factory.mktemp("pp2tied"), MHA_TIED, 1, 2, "torch_dist,legacy")


@pytest.fixture(scope="module")
def deepspeed_zero1(tmp_path_factory) -> Saved:
    return Saved(tmp_path_factory.mktemp("ds"), GQA_UNTIED, 1, 1, "deepspeed")


def run_cli(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def imported_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    cfg = checkpoints.read_model_config(directory)
    model = Transformer(cfg)
    model.load_state_dict(checkpoints.load_model_state(directory, cfg))
    model.eval()
    with torch.no_grad():
        return model(tokens).float()


def import_and_compare(
    capsys, saved: Saved, fmt: str, kind: str, out: Path, folder: Path | None = None
) -> None:
    code, stdout, err = run_cli(
        capsys,
        "ckpt",
        "import",
        folder or saved.folder(fmt),
        "--from",
        kind,
        "--config",
        saved.config,
        "--output",
        out,
    )
    assert code == 0, err
    assert "optimizer: starts fresh" in stdout and "--resume" in stdout
    directory = out / "checkpoints" / "step-00000000"
    logits = imported_logits(directory, saved.tokens)
    error = (logits - saved.truth).abs().max() / saved.truth.abs().max()
    assert error < TOLERANCE, f"{kind} from {fmt}: relative error {error:.2e}"


@pytest.mark.parametrize("fmt, kind", [("torch_dist", "megatron"), ("legacy", "megatron-legacy")])
def test_a_tp2_pp2_gqa_source_gives_megatrons_logits(capsys, tmp_path, tp2_pp2, fmt, kind):
    import_and_compare(capsys, tp2_pp2, fmt, kind, tmp_path / "run")


@pytest.mark.parametrize("fmt, kind", [("torch_dist", "megatron"), ("legacy", "megatron-legacy")])
def test_a_pp2_tied_interleaved_source_gives_megatrons_logits(
    capsys, tmp_path, pp2_tied, fmt, kind
):
    import_and_compare(capsys, pp2_tied, fmt, kind, tmp_path / "run")


def test_a_deepspeed_zero1_checkpoint_gives_megatrons_logits(capsys, tmp_path, deepspeed_zero1):
    import_and_compare(capsys, deepspeed_zero1, "deepspeed", "deepspeed", tmp_path / "run")


def test_the_iteration_folder_itself_imports_too(capsys, tmp_path, tp2_pp2):
    folder = tp2_pp2.folder("legacy") / "iter_0000010"
    code, _, err = run_cli(
        capsys,
        "ckpt",
        "import",
        folder,
        "--from",
        "megatron-legacy",
        "--config",
        tp2_pp2.config,
        "--output",
        tmp_path / "run",
    )
    assert code == 0, err


def test_a_resumed_run_starts_at_megatrons_loss_on_its_first_batch(tmp_path, tp2_pp2, capsys):
    """Step 1 of a goodput run (2 ranks, tensor parallel) resumed from the TP 2 x PP 2 import
    logs the loss Megatron's forward gives on that step's batch."""
    out = tmp_path / "imported"
    assert (
        run_cli(
            capsys,
            "ckpt",
            "import",
            tp2_pp2.folder("torch_dist"),
            "--from",
            "megatron",
            "--config",
            tp2_pp2.config,
            "--output",
            out,
        )[0]
        == 0
    )
    data = tmp_path / "data"
    data.mkdir()
    file_list = write_random_corpus(data, vocab_size=128, num_docs=200, lengths=(20, 90))
    config = tmp_path / "run.toml"
    config.write_text(
        tp2_pp2.config.read_text()
        + "\n[train]\nsteps = 2\ntokens_per_step = 256\nseq_len = 32\nmicro_batch_size = 4\n"
        + f'run_dir = "{tmp_path / "run"}"\n'
        + f'\n[data]\nfile_list = "{file_list}"\ncache = "{tmp_path / "cache"}"\n'
        + '\n[parallel]\nprecision = "fp32"\ntp = 2\n'
    )
    resume = out / "checkpoints" / "step-00000000"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "goodput",
            "launch",
            "--nproc",
            "2",
            "--",
            sys.executable,
            "-m",
            "goodput",
            "train",
            str(config),
            "--resume",
            str(resume),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resume: from {resume}" in result.stdout
    metrics = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    first = next(m for m in metrics if m.get("step") == 1)
    cfg = load_config(RunConfig, config)
    plan = plan_batches(cfg.train, 1)
    blend_dir, _ = build_blend(blend_spec(cfg, plan))
    samples = BlendedSamples(blend_dir)
    batch = torch.stack(
        [torch.from_numpy(samples[i].astype("int64")) for i in range(plan.global_batch_size)]
    )
    megatron_loss = tp2_pp2.megatron_forward(batch)["loss"].item()
    assert first["loss"] == pytest.approx(megatron_loss, rel=1e-5)
    # Far from a fresh model's ln(vocab): the step began from the imported weights.
    assert abs(megatron_loss - math.log(128)) > 1e-2


# --- refusals: hostile, damaged and mismatched sources (copies of the TP 2 x PP 2 save) ---


def copy_of(saved: Saved, fmt: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved.folder(fmt), tmp_path / fmt))


class RunsCode:
    """Pickled, it asks the loader to call os.system: it must never run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def assert_refused(capsys, tmp_path, folder, kind, config, code_expected, *phrases):
    out = tmp_path / "run"
    code, _, err = run_cli(
        capsys, "ckpt", "import", folder, "--from", kind, "--config", config, "--output", out
    )
    assert code == code_expected, err
    assert err.startswith("goodput: error: ") and err.count("\n") == 1, err
    for phrase in phrases:
        assert phrase in err, err
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


@pytest.mark.parametrize(
    "where", ["mp_rank_01_001/model_optim_rng.pt", "mp_rank_00_000/model_optim_rng.pt"]
)
def test_a_hostile_pickle_in_a_legacy_checkpoint_is_refused_with_nothing_run(
    capsys, tmp_path, tp2_pp2, where
):
    folder = copy_of(tp2_pp2, "legacy", tmp_path)
    marker = tmp_path / "ran"
    target = folder / "iter_0000010" / where
    torch.save({"args": Namespace(num_layers=4), "model": {"x": RunsCode(marker)}}, target)
    assert_refused(
        capsys,
        tmp_path,
        folder,
        "megatron-legacy",
        tp2_pp2.config,
        1,
        str(target),
        "nothing in it was run",
        "posix.system",
    )
    assert not marker.exists()


def test_a_hostile_common_pt_is_refused_with_nothing_run(capsys, tmp_path, tp2_pp2):
    folder = copy_of(tp2_pp2, "torch_dist", tmp_path)
    marker = tmp_path / "ran"
    torch.save({"args": RunsCode(marker)}, folder / "iter_0000010" / "common.pt")
    assert_refused(
        capsys,
        tmp_path,
        folder,
        "megatron",
        tp2_pp2.config,
        1,
        "common.pt",
        "nothing in it was run",
    )
    assert not marker.exists()


@pytest.mark.parametrize(
    "field, value, phrases",
    [
        ("norm_eps", "1e-6", ["[model] norm_eps", "args.norm_epsilon = 1e-05"]),
        ("num_kv_heads", "4", ["[model] num_kv_heads", "args.num_query_groups = 2"]),
        (
            "vocab_size",
            "120",
            ["[model] vocab_size", "padded the vocabulary", "set vocab_size = 128"],
        ),
        ("rope_theta", "500000.0", ["[model] rope_theta", "args.rotary_base = 10000.0"]),
        (
            "tie_embeddings",
            "true",
            ["[model] tie_embeddings", "untie_embeddings_and_output_weights"],
        ),
    ],
)
@pytest.mark.parametrize("fmt, kind", [("torch_dist", "megatron"), ("legacy", "megatron-legacy")])
def test_args_that_differ_from_the_config_name_both_sides(
    capsys, tmp_path, tp2_pp2, fmt, kind, field, value, phrases
):
    text = tp2_pp2.config.read_text()
    lines = [line for line in text.splitlines() if not line.startswith(f"{field} =")]
    config = tmp_path / "model.toml"
    config.write_text("\n".join([*lines, f"{field} = {value}"]) + "\n")
    assert_refused(capsys, tmp_path, tp2_pp2.folder(fmt), kind, config, 2, str(config), *phrases)


def test_a_model_megatron_computes_differently_is_refused(capsys, tmp_path, tp2_pp2):
    folder = copy_of(tp2_pp2, "torch_dist", tmp_path)
    common = folder / "iter_0000010" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].swiglu = False
    torch.save(state, common)
    assert_refused(
        capsys, tmp_path, folder, "megatron", tp2_pp2.config, 2, "args.swiglu = False", "SwiGLU"
    )


def test_a_missing_rank_file_is_named(capsys, tmp_path, tp2_pp2):
    folder = copy_of(tp2_pp2, "legacy", tmp_path)
    shutil.rmtree(folder / "iter_0000010" / "mp_rank_01_000")
    assert_refused(
        capsys, tmp_path, folder, "megatron-legacy", tp2_pp2.config, 2, "TP rank 1, PP rank 0"
    )


def test_a_truncated_torch_dist_file_is_refused(capsys, tmp_path, tp2_pp2):
    folder = copy_of(tp2_pp2, "torch_dist", tmp_path)
    data = sorted((folder / "iter_0000010").glob("__*.distcp"), key=lambda p: p.stat().st_size)[-1]
    os.truncate(data, data.stat().st_size // 2)
    assert_refused(capsys, tmp_path, folder, "megatron", tp2_pp2.config, 1, data.name)


def test_a_bad_tracker_file_is_named(capsys, tmp_path, tp2_pp2):
    folder = copy_of(tp2_pp2, "legacy", tmp_path)
    (folder / "latest_checkpointed_iteration.txt").write_text("../../etc")
    assert_refused(
        capsys,
        tmp_path,
        folder,
        "megatron-legacy",
        tp2_pp2.config,
        1,
        "latest_checkpointed_iteration.txt",
        "not an iteration",
    )


def test_the_options_are_checked(capsys, tmp_path, tp2_pp2):
    code, _, err = run_cli(
        capsys,
        "ckpt",
        "import",
        tp2_pp2.folder("legacy"),
        "--from",
        "megatron-legacy",
        "--output",
        tmp_path / "r",
    )
    assert code == 2 and "--config" in err
    code, _, err = run_cli(
        capsys,
        "ckpt",
        "import",
        tmp_path,
        "--from",
        "hf",
        "--config",
        tp2_pp2.config,
        "--output",
        tmp_path / "r",
    )
    assert code == 2 and "leave --config out" in err


def test_import_hf_is_the_deprecated_spelling_of_from_hf(capsys, tmp_path):
    code, _, err = run_cli(capsys, "ckpt", "import-hf", tmp_path / "none", tmp_path / "run")
    assert "goodput ckpt import-hf HF_DIR OUT_DIR is deprecated" in err
    assert "goodput ckpt import HF_DIR --from hf --output OUT_DIR" in err
    assert code == 2 and f"{tmp_path / 'none'}" in err


def test_a_legacy_checkpoint_of_pre_core_names_is_named_as_not_yet(capsys, tmp_path, tp2_pp2):
    folder = copy_of(tp2_pp2, "legacy", tmp_path)
    for path in (folder / "iter_0000010").glob("mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        state["model"] = {f"language_model.{key}": value for key, value in state["model"].items()}
        torch.save(state, path)
    assert_refused(
        capsys, tmp_path, folder, "megatron-legacy", tp2_pp2.config, 2, "before megatron-core"
    )


def test_virtual_pipeline_stages_are_named_as_not_yet(capsys, tmp_path, tp2_pp2):
    folder = copy_of(tp2_pp2, "legacy", tmp_path)
    path = folder / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model0"] = state.pop("model")
    torch.save(state, path)
    assert_refused(capsys, tmp_path, folder, "megatron-legacy", tp2_pp2.config, 2, "virtual")


def deepspeed_states(folder: Path) -> Path:
    return folder / "global_step10" / "mp_rank_00_model_states.pt"


def test_a_wrapped_deepspeed_module_imports(capsys, tmp_path, deepspeed_zero1):
    folder = copy_of(deepspeed_zero1, "deepspeed", tmp_path)
    state = torch.load(deepspeed_states(folder), weights_only=False)
    state["module"] = {f"module.{key}": value for key, value in state["module"].items()}
    torch.save(state, deepspeed_states(folder))
    out = tmp_path / "run"
    argv = ["ckpt", "import", folder, "--from", "deepspeed", "--config", deepspeed_zero1.config]
    assert run_cli(capsys, *argv, "--output", out)[0] == 0
    logits = imported_logits(out / "checkpoints" / "step-00000000", deepspeed_zero1.tokens)
    assert (logits - deepspeed_zero1.truth).abs().max() / deepspeed_zero1.truth.abs().max() < 1e-5


def test_zero3_and_universal_deepspeed_checkpoints_are_named_as_not_yet(
    capsys, tmp_path, deepspeed_zero1
):
    folder = copy_of(deepspeed_zero1, "deepspeed", tmp_path)
    state = torch.load(deepspeed_states(folder), weights_only=False)
    state["ds_config"]["zero_optimization"]["stage"] = 3
    torch.save(state, deepspeed_states(folder))
    config = deepspeed_zero1.config
    assert_refused(capsys, tmp_path, folder, "deepspeed", config, 2, "ZeRO-3", "not imported yet")
    (folder / "global_step10" / "zero").mkdir()
    assert_refused(capsys, tmp_path, folder, "deepspeed", config, 2, "universal checkpoint")


def rewrite_metadata(folder: Path, change) -> None:
    path = folder / "iter_0000010" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    change(metadata.state_dict_metadata)
    path.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize(
    "key, size, phrase",
    [
        ("embedding.word_embeddings.weight", [2**40, 64], "the [model] config needs [128, 64]"),
        ("decoder.layers.mlp.linear_fc2.weight", [2**40, 64, 96], "stacks [1099511627776]"),
    ],
)
def test_sizes_in_torch_dist_metadata_are_checked_before_anything_is_allocated(
    capsys, tmp_path, tp2_pp2, key, size, phrase
):
    folder = copy_of(tp2_pp2, "torch_dist", tmp_path)

    def grow(entries):
        entries[key].size = torch.Size(size)

    rewrite_metadata(folder, grow)
    assert_refused(capsys, tmp_path, folder, "megatron", tp2_pp2.config, 2, key, phrase)


def test_a_chunk_outside_its_tensor_is_refused(capsys, tmp_path, tp2_pp2):
    folder = copy_of(tp2_pp2, "torch_dist", tmp_path)

    def move(entries):
        entries["output_layer.weight"].chunks[1].offsets = torch.Size([100, 0])

    rewrite_metadata(folder, move)
    assert_refused(capsys, tmp_path, folder, "megatron", tp2_pp2.config, 1, "lies outside it")


def test_a_nan_in_the_last_stage_removes_what_was_written(capsys, tmp_path, tp2_pp2):
    """The import streams: a bad tensor met after others were written leaves nothing behind."""
    folder = copy_of(tp2_pp2, "legacy", tmp_path)
    path = folder / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.1.mlp.linear_fc2.weight"][0, 0] = float("nan")
    torch.save(state, path)
    assert_refused(
        capsys, tmp_path, folder, "megatron-legacy", tp2_pp2.config, 1, "'blocks.3.mlp.w2.weight'"
    )
    assert not (tmp_path / "run" / "checkpoints" / "step-00000000").exists()


def test_the_tied_head_and_rope_scaling_are_named_in_goodputs_terms():
    tied = replace(TINY_MODEL, tie_embeddings=True)
    with pytest.raises(GoodputError) as caught:
        megatron.check_args({"untie_embeddings_and_output_weights": True}, tied, "SRC", "m.toml")
    assert caught.value.where == "m.toml [model] tie_embeddings"
    assert (
        "is True, but args.untie_embeddings_and_output_weights = True in SRC" in caught.value.what
    )
    assert caught.value.fix.endswith("(False)")
    scaled = {"use_rope_scaling": True, "rope_scaling_factor": 8.0}
    with pytest.raises(GoodputError, match="set rope_scaling = 'llama3' and rope_scaling_factor"):
        megatron.check_args(scaled, TINY_MODEL, "SRC", "m.toml")
    llama3 = replace(TINY_MODEL, rope_scaling="llama3", rope_scaling_factor=8.0)
    megatron.check_args(scaled, llama3, "SRC", "m.toml")
    with pytest.raises(GoodputError, match="trained without RoPE scaling"):
        megatron.check_args({}, llama3, "SRC", "m.toml")


def test_transformer_engines_extra_state_in_a_legacy_file_is_kept_as_data(
    capsys, tmp_path, tp2_pp2
):
    """Megatron-LM on GPUs saves each Transformer Engine layer's ``_extra_state`` (an
    ``io.BytesIO`` in older TE): read as an inert stand-in, never rebuilt, never refused."""
    folder = copy_of(tp2_pp2, "legacy", tmp_path)
    for path in (folder / "iter_0000010").glob("mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        state["model"]["decoder.layers.0.self_attention.linear_qkv._extra_state"] = io.BytesIO(
            b"fp8 scaling factors"
        )
        torch.save(state, path)
    import_and_compare(capsys, tp2_pp2, "legacy", "megatron-legacy", tmp_path / "run", folder)


def recipe_model(recipe: Path) -> ModelConfig:
    return load_section(ModelConfig, recipe, "model")


DENSE_RECIPES = [path for path in RECIPES if recipe_model(path).moe is None]
MOE_RECIPES = [path for path in RECIPES if recipe_model(path).moe is not None]


@pytest.mark.parametrize("recipe", DENSE_RECIPES, ids=lambda p: p.stem)
def test_every_dense_recipe_maps_from_megatrons_shapes_on_the_meta_device(recipe):
    """At the recipes' real shapes (405B's 128 heads in 8 groups included), Megatron's tensors
    of those shapes become exactly goodput's model tensors, without a byte allocated."""
    cfg = recipe_model(recipe)
    shapes = megatron.shapes(cfg)

    def tensor(name, layer):
        return torch.empty(shapes[name], device="meta")

    produced = dict(megatron.goodput_tensors(tensor, cfg, rotary_interleaved=False))
    expected = checkpoints.model_shapes(cfg)
    assert {name: tuple(t.shape) for name, t in produced.items()} == {
        name: shape for name, (shape, _dtype) in expected.items()
    }


@pytest.mark.parametrize("recipe", MOE_RECIPES, ids=lambda p: p.stem)
def test_an_moe_config_is_refused_before_the_source_is_read(capsys, tmp_path, recipe):
    (tmp_path / "src").mkdir()
    argv = ["ckpt", "import", tmp_path / "src", "--from", "megatron", "--config", recipe]
    code, _, err = run_cli(capsys, *argv, "--output", tmp_path / "run")
    assert code == 2 and "[model.moe]" in err and "not imported from Megatron yet" in err
