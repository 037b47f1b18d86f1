"""`goodput ckpt`: HF Llama export computes what goodput computes (checked with transformers),
imports come back bit-exact, .pt files round-trip, and user errors are one line with an exit code.

Checkpoints are written the way the trainer writes them: DCP of {"model", "optim"} from
get_state_dict, a run config, train_state.json, .complete last — one of them by 2 FSDP ranks."""

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict

from goodput.cli import main
from goodput.io import write_json, write_marker, write_text
from goodput.rundir import CONFIG, LATEST, TRAIN_STATE, checkpoints_dir, step_dir
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL
from goodput.train.config.model import ModelConfig, MoEConfig
from goodput.train.config.parallel import ParallelConfig
from goodput.train.convert import checkpoints, hf
from goodput.train.model import Transformer
from goodput.train.parallel.parallelize import parallelize

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# head_dim 8: inverse frequencies 1, 0.1, 0.01, 0.001 (wavelengths 6, 63, 628, 6283); with an
# original context of 64, llama3 scaling keeps one, blends one and slows two: every branch.
VARIANTS = {
    "gqa-untied": TINY_MODEL,
    "mha-tied-llama3": replace(
        TINY_MODEL,
        num_kv_heads=None,
        tie_embeddings=True,
        rope_scaling="llama3",
        rope_scaling_factor=4.0,
        rope_original_max_seq_len=64,
        max_seq_len=256,
    ),
    "gqa-tied-linear": replace(
        TINY_MODEL,
        tie_embeddings=True,
        rope_scaling="linear",
        rope_scaling_factor=2.0,
        rope_theta=500000.0,
        norm_eps=1e-6,
    ),
}
TOLERANCE = 1e-5


def tiny_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Weights large enough that attention is far from uniform (a wrong RoPE layout shows) and
    norm weights that differ (a swapped norm shows)."""
    torch.manual_seed(seed)
    model = Transformer(replace(cfg, init_std=0.1))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def reference_state(model: Transformer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def write_small_files(directory: Path, cfg: ModelConfig, step: int, complete: bool) -> None:
    # A resolved run config holds more tables than [model]; conversion reads [model] only.
    write_text(directory / CONFIG, checkpoints.model_config_toml(cfg) + "\n[train]\nsteps = 8\n")
    write_json(directory / TRAIN_STATE, {"step": step, "loader": {"consumed_samples": 64}})
    if complete:
        write_marker(directory)


def save_checkpoint(
    run_dir: Path, model: Transformer, step: int = 100, *, complete: bool = True
) -> Path:
    directory = step_dir(checkpoints_dir(run_dir), step)
    directory.mkdir(parents=True)
    optimizer = torch.optim.AdamW(model.parameters())
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory)
    write_small_files(directory, model.cfg, step, complete)
    return directory


def hf_model_from(folder: Path):
    # Imported here: the FSDP ranks re-import this module, and transformers costs seconds.
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    hf_model = hf_model_from(folder).eval()
    assert hf_model.dtype == torch.float32
    with torch.no_grad():
        return hf_model(input_ids=tokens).logits


def goodput_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


def run_cli(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, expected_code: int, *phrases: str) -> None:
    assert code == expected_code
    assert err.startswith("goodput: error: ") and err.count("\n") == 1, err
    for phrase in phrases:
        assert phrase in err, err


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_export_matches_transformers_and_imports_back_bit_exact(tmp_path, capsys, variant):
    model = tiny_model(VARIANTS[variant])
    original = reference_state(model)
    directory = save_checkpoint(tmp_path / "run", model)
    out = tmp_path / "hf"

    code, stdout, _ = run_cli(capsys, "ckpt", "export-hf", directory, out)
    assert code == 0 and "HuggingFace Llama folder written" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (
        "lm_head.weight" not in load_file(out / "model.safetensors") or not model.cfg.tie_embeddings
    )

    tokens = torch.randint(
        0, model.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3)
    )
    ours, theirs = goodput_logits(model, tokens), hf_logits(out, tokens)
    assert (ours - theirs).abs().max().item() < TOLERANCE

    code, stdout, _ = run_cli(
        capsys, "ckpt", "import", out, "--from", "hf", "--output", tmp_path / "imported"
    )
    assert code == 0 and "--resume" in stdout
    imported = step_dir(checkpoints_dir(tmp_path / "imported"), 0)
    assert json.loads((imported / TRAIN_STATE).read_text()) == {"step": 0, "model_only": True}
    assert (checkpoints_dir(tmp_path / "imported") / LATEST).read_text() == imported.name + "\n"
    cfg = checkpoints.read_model_config(imported)
    assert cfg == model.cfg  # the export loses nothing of the [model] table
    loaded = checkpoints.load_model_state(imported, cfg)
    assert list(loaded) == list(original)
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor), name


def test_rope_layout_matters_at_this_tolerance(tmp_path):
    """The negative control: exported without the q/k row permutation, logits are far off —
    so the equality above really checks the RoPE layout."""
    model = tiny_model(TINY_MODEL)
    directory = save_checkpoint(tmp_path / "run", model)
    checkpoints.export_hf(directory, tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    for name in list(tensors):
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            ours = hf.goodput_name(name)
            tensors[name] = model.state_dict()[ours].clone()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    tokens = torch.randint(0, 61, (1, 32), generator=torch.Generator().manual_seed(4))
    difference = (goodput_logits(model, tokens) - hf_logits(tmp_path / "hf", tokens)).abs().max()
    assert difference.item() > 1000 * TOLERANCE


def test_permutation_is_hf_convert_script_and_inverts():
    weight = torch.arange(2 * 8 * 3, dtype=torch.float32).view(16, 3)
    halves = hf.interleaved_to_halves(weight, num_heads=2)
    # Per head of 8 dims: rows 0, 2, 4, 6 then 1, 3, 5, 7.
    assert halves[:8, 0].tolist() == [weight[r, 0].item() for r in (0, 2, 4, 6, 1, 3, 5, 7)]
    assert torch.equal(hf.halves_to_interleaved(halves, num_heads=2), weight)


def _save_fsdp_checkpoint(rank: int, world_size: int, directory: str, cfg: ModelConfig) -> None:
    model = tiny_model(cfg)
    parallelize(model, ParallelConfig(precision="fp32"))
    optimizer = torch.optim.AdamW(model.parameters())
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory)


def test_checkpoint_of_two_fsdp_ranks_exports_and_consolidates(tmp_path, capsys):
    cfg = replace(TINY_MODEL, tie_embeddings=True)
    directory = step_dir(checkpoints_dir(tmp_path / "run"), 8)
    directory.mkdir(parents=True)
    run_distributed(_save_fsdp_checkpoint, 2, str(directory), cfg)
    write_small_files(directory, cfg, 8, complete=True)
    assert len(list(directory.glob("*.distcp"))) == 2  # really sharded
    model = tiny_model(cfg)

    code, _, _ = run_cli(capsys, "ckpt", "to-torch", directory, tmp_path / "model.pt")
    assert code == 0
    consolidated = torch.load(tmp_path / "model.pt", weights_only=True)
    assert list(consolidated) == list(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(consolidated[name], tensor), name

    assert run_cli(capsys, "ckpt", "export-hf", directory, tmp_path / "hf")[0] == 0
    tokens = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(5))
    difference = (goodput_logits(model, tokens) - hf_logits(tmp_path / "hf", tokens)).abs().max()
    assert difference.item() < TOLERANCE


def test_torch_round_trip(tmp_path, capsys):
    model = tiny_model(VARIANTS["gqa-tied-linear"])
    directory = save_checkpoint(tmp_path / "run", model)
    file = tmp_path / "model.pt"
    assert run_cli(capsys, "ckpt", "to-torch", directory, file)[0] == 0
    state = torch.load(file, weights_only=True)
    assert state["output.weight"].data_ptr() == state["embedding.weight"].data_ptr()  # stored once

    config = tmp_path / "model.toml"
    config.write_text(checkpoints.model_config_toml(model.cfg))
    code, stdout, _ = run_cli(capsys, "ckpt", "from-torch", file, config, tmp_path / "again")
    assert code == 0 and "--resume" in stdout
    again = step_dir(checkpoints_dir(tmp_path / "again"), 0)
    loaded = checkpoints.load_model_state(again, checkpoints.read_model_config(again))
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_import_of_a_folder_transformers_saved_sharded(tmp_path, capsys):
    """transformers' own save_pretrained: its config.json format and a sharded index."""
    model = tiny_model(VARIANTS["mha-tied-llama3"])
    checkpoints.export_hf(save_checkpoint(tmp_path / "run", model), tmp_path / "hf")
    hf_model = hf_model_from(tmp_path / "hf")
    hf_model.save_pretrained(tmp_path / "resaved", max_shard_size="20KB")
    assert (tmp_path / "resaved" / checkpoints.HF_INDEX).is_file()

    assert (
        run_cli(
            capsys,
            "ckpt",
            "import",
            tmp_path / "resaved",
            "--from",
            "hf",
            "--output",
            tmp_path / "out",
        )[0]
        == 0
    )
    imported = step_dir(checkpoints_dir(tmp_path / "out"), 0)
    assert checkpoints.read_model_config(imported) == model.cfg
    loaded = checkpoints.load_model_state(imported, model.cfg)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_moe_export_is_refused(tmp_path, capsys):
    cfg = replace(TINY_MODEL, moe=MoEConfig(num_experts=2, top_k=1, expert_ffn_dim=16))
    directory = save_checkpoint(tmp_path / "run", Transformer(cfg))
    code, _, err = run_cli(capsys, "ckpt", "export-hf", directory, tmp_path / "hf")
    assert_one_line_error(code, err, 2, "mixture-of-experts", "to-torch")
    assert not (tmp_path / "hf").exists()


def test_incomplete_checkpoint_is_refused(tmp_path, capsys):
    directory = save_checkpoint(tmp_path / "run", tiny_model(TINY_MODEL), complete=False)
    for argv in (("export-hf", directory, tmp_path / "hf"), ("to-torch", directory, "m.pt")):
        code, _, err = run_cli(capsys, "ckpt", *argv)
        assert_one_line_error(code, err, 1, "incomplete", "ckpt list")
    assert not (tmp_path / "hf").exists()


def test_non_empty_out_dir_is_refused(tmp_path, capsys):
    directory = save_checkpoint(tmp_path / "run", tiny_model(TINY_MODEL))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "ckpt", "export-hf", directory, out)
    assert_one_line_error(code, err, 2, "not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")] == []

    assert (
        run_cli(capsys, "ckpt", "import", out, "--from", "hf", "--output", tmp_path / "x")[0] == 2
    )  # no config.json

    # An import must not move the latest of a run that has checkpoints back to step 0.
    checkpoints.export_hf(directory, tmp_path / "hf2")
    code, _, err = run_cli(
        capsys, "ckpt", "import", tmp_path / "hf2", "--from", "hf", "--output", tmp_path / "run"
    )
    assert_one_line_error(code, err, 2, "already holds checkpoints")


def test_from_torch_names_the_first_mismatch(tmp_path, capsys):
    state = tiny_model(TINY_MODEL).state_dict()
    state["blocks.1.mlp.w1.weight"] = torch.zeros(65, 32)
    torch.save(state, tmp_path / "model.pt")
    config = tmp_path / "model.toml"
    config.write_text(checkpoints.model_config_toml(TINY_MODEL))
    code, _, err = run_cli(
        capsys, "ckpt", "from-torch", tmp_path / "model.pt", config, tmp_path / "o"
    )
    assert_one_line_error(code, err, 2, "'blocks.1.mlp.w1.weight' has shape [65, 32]", "[64, 32]")
    assert not checkpoints_dir(tmp_path / "o").exists()

    del state["blocks.1.mlp.w1.weight"]
    torch.save(state, tmp_path / "model.pt")
    code, _, err = run_cli(
        capsys, "ckpt", "from-torch", tmp_path / "model.pt", config, tmp_path / "o"
    )
    assert_one_line_error(code, err, 2, "no 'blocks.1.mlp.w1.weight'")


class NotATensor:
    pass


def test_from_torch_never_unpickles_objects(tmp_path, capsys):
    torch.save({"embedding.weight": NotATensor()}, tmp_path / "evil.pt")
    config = tmp_path / "model.toml"
    config.write_text(checkpoints.model_config_toml(TINY_MODEL))
    code, _, err = run_cli(
        capsys, "ckpt", "from-torch", tmp_path / "evil.pt", config, tmp_path / "o"
    )
    assert_one_line_error(code, err, 1, "not a plain tensor file")


@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        ({"model_type": "mistral"}, "model_type"),
    ],
)
def test_import_refuses_what_goodput_cannot_compute(tmp_path, capsys, change, phrase):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**hf.hf_config(TINY_MODEL), **change}))
    code, _, err = run_cli(
        capsys, "ckpt", "import", folder, "--from", "hf", "--output", tmp_path / "out"
    )
    assert_one_line_error(code, err, 2, phrase)


def test_list_shows_complete_incomplete_and_latest(tmp_path, capsys):
    run = tmp_path / "run"
    model = tiny_model(TINY_MODEL)
    save_checkpoint(run, model, step=100)
    save_checkpoint(run, model, step=200, complete=False)
    write_text(checkpoints_dir(run) / LATEST, "step-00000100\n")

    code, stdout, _ = run_cli(capsys, "ckpt", "list", run)
    assert code == 0
    header, first, second = stdout.splitlines()
    assert header.split() == ["step", "complete", "size", "age"]
    assert first.split()[:2] == ["100", "yes"] and first.endswith("<- latest")
    assert "KiB" in first and "s" in first.split()
    assert second.split()[:2] == ["200", "INCOMPLETE"] and "latest" not in second

    code, stdout, _ = run_cli(capsys, "ckpt", "list", run, "--json")
    info = json.loads(stdout)
    assert info["latest"] == "step-00000100"
    assert [(c["step"], c["complete"], c["latest"]) for c in info["checkpoints"]] == [
        (100, True, True),
        (200, False, False),
    ]
    assert all(c["size_bytes"] > 10_000 for c in info["checkpoints"])

    code, _, err = run_cli(capsys, "ckpt", "list", tmp_path / "nothing")
    assert_one_line_error(code, err, 2, "no checkpoints/ folder")


# Hostile inputs to the importers: each is one line, a non-zero exit and nothing in OUT_DIR.


def safetensors_bytes(header: object, data: bytes = b"", length: int | None = None) -> bytes:
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(text) if length is None else length) + text + data


@pytest.fixture
def hf_folder(tmp_path) -> Path:
    """A valid HF folder of TINY_MODEL, written without a checkpoint (fast)."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf.hf_config(TINY_MODEL)))
    save_file(
        hf.to_hf(tiny_model(TINY_MODEL).state_dict(), TINY_MODEL), folder / "model.safetensors"
    )
    return folder


def import_fails(capsys, folder: Path, out: Path, code: int, *phrases: str) -> None:
    exit_code, _, err = run_cli(capsys, "ckpt", "import", folder, "--from", "hf", "--output", out)
    assert_one_line_error(exit_code, err, code, *phrases)
    assert not out.exists()


CONFIG_CHANGES = [
    ([1, 2], "is not a JSON object"),
    ({"hidden_size": None}, "'hidden_size' is missing"),
    ({"hidden_size": "32"}, "'hidden_size' must be int, got '32'"),
    ({"hidden_size": 0}, "'hidden_size' = 0 is not in"),
    ({"num_hidden_layers": True}, "'num_hidden_layers' must be int, got True"),
    ({"vocab_size": 2**40}, "'vocab_size' = 1099511627776 is not in"),
    ({"intermediate_size": -64}, "'intermediate_size' = -64 is not in"),
    ({"num_key_value_heads": 3}, "num_heads 4 is not a multiple of num_kv_heads 3"),
    ({"rms_norm_eps": float("nan")}, "'rms_norm_eps' = nan is not in"),
    ({"max_position_embeddings": 1.5}, "'max_position_embeddings' must be int"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
    ({"rope_theta": "big"}, "'rope_theta' must be float"),
    ({"rope_scaling": "linear"}, "rope scaling 'linear' is not an object"),
    ({"rope_scaling": {"rope_type": "linear"}}, "'rope_scaling.factor' must be float, got None"),
    ({"rope_scaling": {"rope_type": ["x"]}}, "rope scaling type ['x'] is not supported"),
]


@pytest.mark.parametrize(("change", "phrase"), CONFIG_CHANGES, ids=lambda c: str(c)[:40])
def test_import_refuses_a_malformed_config_json(hf_folder, tmp_path, capsys, change, phrase):
    config = json.loads((hf_folder / "config.json").read_text())
    text = json.dumps(change if isinstance(change, list) else {**config, **change})
    (hf_folder / "config.json").write_text(text)
    import_fails(capsys, hf_folder, tmp_path / "out", 2, "config.json", phrase)


@pytest.mark.parametrize(
    ("content", "phrase"),
    [
        (b'{"model_type": "\xff"}', "is not valid UTF-8 text"),
        (b'{"model_type": ', "is not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
def test_import_refuses_an_unreadable_config_json(hf_folder, tmp_path, capsys, content, phrase):
    (hf_folder / "config.json").write_bytes(content)
    import_fails(capsys, hf_folder, tmp_path / "out", 1, "config.json", phrase)


def one_tensor(dtype: str = "F32", shape: object = (2,), offsets: object = (0, 8)) -> dict:
    return {"norm": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}


SAFETENSORS = {
    "too short": (b"\x01\x00", "shorter than a safetensors header"),
    "huge length": (struct.pack("<Q", 2**63) + b"{}", "announces a header of"),
    "length beyond the file": (safetensors_bytes({}, length=100), "announces a header of 100"),
    "invalid JSON": (safetensors_bytes(b"{not json"), "header that is not valid JSON"),
    "invalid UTF-8": (safetensors_bytes(b'{"\xff": 1}'), "header that is not valid UTF-8"),
    "not an object": (safetensors_bytes([1]), "header that is not a JSON object"),
    "entry not an object": (safetensors_bytes({"x": 3}), "described by 3"),
    "unknown dtype": (safetensors_bytes(one_tensor("Q4"), bytes(8)), "of dtype 'Q4'"),
    "integer dtype": (safetensors_bytes(one_tensor("I64"), bytes(8)), "of dtype 'I64'"),
    "negative shape": (safetensors_bytes(one_tensor(shape=[-2]), bytes(8)), "shape [-2]"),
    "offsets past the end": (
        safetensors_bytes(one_tensor(offsets=[0, 800]), bytes(8)),
        "at bytes 0-800 of a 8-byte data section",
    ),
    "shape and bytes differ": (
        safetensors_bytes(one_tensor(shape=[3]), bytes(8)),
        "of shape [3] F32 in 8 bytes",
    ),
    "huge shape": (
        safetensors_bytes(one_tensor(shape=[2**62] * 50), bytes(8)),
        "F32 in 8 bytes",
    ),
    "trailing bytes": (safetensors_bytes(one_tensor(), bytes(12)), "4 bytes after its last"),
    "bad metadata": (safetensors_bytes({"__metadata__": {"a": 1}}), "__metadata__"),
}


@pytest.mark.parametrize(("content", "phrase"), SAFETENSORS.values(), ids=list(SAFETENSORS))
def test_import_refuses_a_malformed_safetensors_header(
    hf_folder, tmp_path, capsys, content, phrase
):
    (hf_folder / "model.safetensors").write_bytes(content)
    import_fails(capsys, hf_folder, tmp_path / "out", 1, "model.safetensors", phrase)


def test_import_refuses_weights_that_do_not_fit_or_are_not_finite(hf_folder, tmp_path, capsys):
    weights = hf_folder / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"] = torch.ones(33)
    save_file(tensors, weights)
    import_fails(
        capsys, hf_folder, tmp_path / "out", 2, "'model.norm.weight' has shape [33]", "[32]"
    )

    tensors["model.norm.weight"] = torch.full((32,), 1e300, dtype=torch.float64)  # inf in fp32
    save_file(tensors, weights)
    import_fails(capsys, hf_folder, tmp_path / "out", 1, "'norm.weight' holds NaN or infinite")


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (7, 3)),  # the RoPE permutation's view failed
        ("model.layers.1.self_attn.k_proj.weight", (16, 33)),
        ("model.embed_tokens.weight", (122, 32)),
        ("model.layers.0.mlp.down_proj.weight", (64, 32)),  # transposed
        ("model.norm.weight", (32, 1)),
    ],
)
def test_import_names_the_file_tensor_and_shapes_of_a_misshapen_tensor(
    hf_folder, tmp_path, capsys, name, shape
):
    weights = hf_folder / "model.safetensors"
    tensors = load_file(weights)
    expected = list(tensors[name].shape)
    tensors[name] = torch.zeros(shape)
    save_file(tensors, weights)
    code, out, err = run_cli(
        capsys, "ckpt", "import", hf_folder, "--from", "hf", "--output", tmp_path / "out"
    )
    assert code == 2 and f"reading {weights}" not in out  # refused before any tensor is read
    assert err == (
        f"goodput: error: {weights}: tensor '{name}' has shape {list(shape)}, config.json needs "
        f"{expected}; pass the weights this config.json describes\n"
    )
    assert not (tmp_path / "out").exists()


def test_import_reads_only_files_in_the_folder_its_index_names(hf_folder, tmp_path, capsys):
    outside = tmp_path / "outside.safetensors"
    (hf_folder / "model.safetensors").rename(outside)
    index = hf_folder / "model.safetensors.index.json"
    for weight_map in ({"x": "../outside.safetensors"}, {"x": str(outside)}, {"x": 3}, None):
        index.write_text(json.dumps({"weight_map": weight_map}))
        import_fails(capsys, hf_folder, tmp_path / "out", 1, "index.json", "no weight_map")
    index.write_text("[]")
    import_fails(capsys, hf_folder, tmp_path / "out", 1, "index.json", "no weight_map")


def test_import_refuses_a_tensor_in_two_shards(hf_folder, tmp_path, capsys):
    tensors = load_file(hf_folder / "model.safetensors")
    save_file(tensors, hf_folder / "a.safetensors")
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, hf_folder / "b.safetensors")
    weight_map = {name: "a.safetensors" for name in tensors}
    weight_map["model.norm.weight"] = "b.safetensors"  # and a.safetensors holds it too
    (hf_folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    import_fails(capsys, hf_folder, tmp_path / "out", 2, "holds 'model.norm.weight' again")


@pytest.mark.parametrize(
    ("payload", "code", "phrase"),
    [
        (b"", 1, "not a plain tensor file"),
        (b"\x00garbage" * 10, 1, "not a plain tensor file"),
        ([torch.zeros(2)], 2, "does not hold a dict of name -> dense floating-point tensor"),
        ({"embedding.weight": torch.zeros(2, dtype=torch.int64)}, 2, "dense floating-point"),
        ({"embedding.weight": torch.zeros(2, 2).to_sparse()}, 2, "dense floating-point"),
        ({1: torch.zeros(2)}, 2, "does not hold a dict"),
        ({"model": {"x": "text"}}, 2, "does not hold a dict"),
    ],
)
def test_from_torch_refuses_what_is_not_a_dict_of_weights(tmp_path, capsys, payload, code, phrase):
    file = tmp_path / "model.pt"
    if isinstance(payload, bytes):
        file.write_bytes(payload)
    else:
        torch.save(payload, file)
    config = tmp_path / "model.toml"
    config.write_text(checkpoints.model_config_toml(TINY_MODEL))
    exit_code, _, err = run_cli(capsys, "ckpt", "from-torch", file, config, tmp_path / "o")
    assert_one_line_error(exit_code, err, code, phrase)
    assert not (tmp_path / "o").exists()
