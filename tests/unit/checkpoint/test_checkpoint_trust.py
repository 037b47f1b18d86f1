"""Checkpoints from a shared or downloaded folder are hostile input: a crafted ``.metadata``
pickle never runs on any command that reads checkpoints, damaged files are refused by their
checksums (``--resume auto`` falls back and says so), and broken small files are one line."""

import json
import os
import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from goodput.checkpoint.metadata import read_metadata
from goodput.checkpoint.verify import assign
from goodput.cli import main
from goodput.config import to_toml
from goodput.errors import GoodputError
from goodput.rundir import CONFIG, TRAIN_STATE, checkpoints_dir, step_dir
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import tiny_run_config
from goodput.train.loop import train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A run of 8 steps with complete checkpoints at steps 4 and 8."""
    base = tmp_path_factory.mktemp("saved")
    cfg = tiny_run_config(base)
    cfg = replace(
        cfg,
        train=replace(cfg.train, run_dir=str(base / "run")),
        checkpoint=replace(cfg.checkpoint, interval_steps=4),
    )
    train(cfg)
    (base / "run.toml").write_text(to_toml(cfg))
    return base


@pytest.fixture
def run(saved_run, tmp_path) -> Path:
    """A private copy of the saved run; returns its config file (train.run_dir inside it)."""
    shutil.copytree(saved_run, tmp_path / "copy")
    config = tmp_path / "copy" / "run.toml"
    config.write_text(config.read_text().replace(str(saved_run), str(tmp_path / "copy")))
    return config


def run_dir(config: Path) -> Path:
    return config.parent / "run"


def step(config: Path, n: int) -> Path:
    return step_dir(checkpoints_dir(run_dir(config)), n)


class Payload:
    """Unpickling this runs ``os.system``, as an attacker's ``.metadata`` would."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class EvalPayload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return eval, (f"open({str(self.marker)!r}, 'w').close()",)


def plant(directory: Path, payload: object) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(payload))


def one_line_error(capsys, *argv: object, code: int = 1) -> str:
    assert main([str(a) for a in argv]) == code
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]  # progress lines (the blend) may come first
    assert last.startswith("goodput: error: "), err
    return last


def test_the_payload_is_live_under_torchs_own_reader(tmp_path):
    # Not a vacuous test: torch's FileSystemReader runs it.
    marker = tmp_path / "ran"
    plant(tmp_path, Payload(f"touch {marker}"))
    with pytest.raises(AttributeError):  # after the payload ran: it returned an int
        FileSystemReader(tmp_path).read_metadata()
    assert marker.exists()


@pytest.mark.parametrize("kind", ["os.system", "eval"])
def test_a_crafted_metadata_runs_on_no_command(run, tmp_path, capsys, kind):
    marker = tmp_path / "pwned"
    payload = Payload(f"touch {marker}") if kind == "os.system" else EvalPayload(marker)
    for n in (4, 8):
        plant(step(run, n), payload)
    newest = step(run, 8)
    # auto: both checkpoints are damaged, named, and the run starts fresh.
    assert main(["train", str(run), "train.steps=1"]) == 0
    out = capsys.readouterr().out
    metadata = newest / ".metadata"
    assert f"skipping checkpoint {newest}: damaged ({metadata}: refused as checkpoint" in out
    err = one_line_error(capsys, "train", run, "--resume", newest)
    assert "refused as checkpoint metadata" in err and "not checkpoint metadata" in err
    one_line_error(capsys, "ckpt", "export-hf", newest, tmp_path / "hf")
    one_line_error(capsys, "ckpt", "to-torch", newest, tmp_path / "model.pt")
    assert main(["ckpt", "list", str(run_dir(run))]) == 0
    # Copied to "node-local" disk, and resumed from there.
    local = tmp_path / "local"
    copying = ["broadcast", "--checkpoint", run_dir(run), "--transport", "local"]
    assert main([str(a) for a in [*copying, "--hosts", "a", "--dest", f"{local}/{{host}}"]]) == 0
    local_dir = f"checkpoint.local_dir={str(local / 'a')!r}"
    err = one_line_error(capsys, "train", run, local_dir, "--resume", newest)
    assert "refused as checkpoint metadata" in err
    assert not marker.exists()
    assert not (tmp_path / "hf").exists() and not (tmp_path / "model.pt").exists()


def test_the_reader_refuses_globals_outside_the_list_even_through_an_allowed_module(tmp_path):
    # Protocol 4 resolves dotted names attribute by attribute: "Metadata.__init__.__globals__"
    # would reach the module's globals from an allowed class.
    module = b"torch.distributed.checkpoint.metadata"
    name = b"Metadata.__init__"
    crafted = (
        b"\x80\x04"
        + b"\x8c"
        + bytes([len(module)])
        + module
        + b"\x8c"
        + bytes([len(name)])
        + name
        + b"\x93)R."
    )
    (tmp_path / ".metadata").write_bytes(crafted)
    with pytest.raises(GoodputError, match=r"refused to load .*Metadata.__init__"):
        read_metadata(tmp_path)


def test_a_metadata_naming_files_outside_the_checkpoint_is_refused(run):
    metadata = read_metadata(step(run, 8))
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../../etc/passwd"
    (step(run, 8) / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(GoodputError, match=r"names the data file '../../../etc/passwd'"):
        read_metadata(step(run, 8))


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_refused_and_auto_falls_back_by_name(run, capsys):
    damaged = step(run, 8) / "__0_0.distcp"
    flip_a_byte(damaged)
    # The cheap checks (marker, sizes, metadata) all pass: only the checksum can tell.
    err = one_line_error(capsys, "train", run, "--resume", step(run, 8))
    assert "__0_0.distcp: checksum differs" in err
    err = one_line_error(capsys, "ckpt", "to-torch", step(run, 8), run.parent / "m.pt")
    assert "__0_0.distcp: checksum differs" in err
    assert main(["train", str(run)]) == 0
    out = capsys.readouterr().out
    assert (
        f"warning: refusing checkpoint {step(run, 8)}: __0_0.distcp: checksum differs from the "
        "saved checkpoint's; falling back to the newest older complete checkpoint"
    ) in out
    assert f"resume: from {step(run, 4)} (step 4)" in out and "checksums of " in out


def test_verification_can_be_switched_off(run, capsys):
    flip_a_byte(step(run, 8) / "__0_0.distcp")
    argv = ["train", str(run), "checkpoint.verify_checksums=false"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"resume: from {step(run, 8)} (step 8)" in out and "refusing" not in out


@pytest.mark.parametrize(
    ("name", "content", "phrase"),
    [
        (TRAIN_STATE, "[1, 2]", "is an array, not a JSON object"),
        (TRAIN_STATE, '{"step": 8, "world_size": 1}', "field loader must be an object"),
        (TRAIN_STATE, "[" * 100_000, "is JSON nested too deeply"),
        (TRAIN_STATE, b"\xff\xfe", "is not valid UTF-8"),
        ("checksums.json", '{"algorithm": "sha256", "files": {"../x": "00"}}', "names '../x'"),
        (CONFIG, "model = [", "invalid TOML"),
        ("rng/rank-00000.json", '{"python": [3, [1, 2], null]}', "not a goodput RNG state"),
        ("rng/rank-00000.json", '{"python": 1}', "not a goodput RNG state"),
    ],
)
def test_a_broken_small_file_is_one_line_naming_it(run, capsys, name, content, phrase):
    target = step(run, 8) / name
    assert target.is_file()  # a file goodput wrote, now broken
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    verify = "false" if name != "checksums.json" else "true"
    err = one_line_error(
        capsys,
        "train",
        run,
        f"checkpoint.verify_checksums={verify}",
        "--resume",
        step(run, 8),
    )
    assert str(target) in err and phrase in err


@pytest.mark.parametrize(
    ("key", "value", "phrase"),
    [
        ("noise_scale", {"steps": "8", "gradient_sq": 0.5, "trace": 1.0}, "'steps'"),
        ("loss_spikes", {"losses": [1e999]}, "loss"),
        ("lr_reference_tokens", -4, "lr_reference_tokens"),
    ],
)
def test_a_broken_diagnostics_state_is_one_line_naming_it(run, capsys, key, value, phrase):
    target = step(run, 8) / TRAIN_STATE
    state = json.loads(target.read_text())
    assert key in state  # the loop saved it
    target.write_text(json.dumps({**state, key: value}))
    err = one_line_error(
        capsys, "train", run, "checkpoint.verify_checksums=false", "--resume", step(run, 8)
    )
    assert str(target) in err and phrase in err


def edited(state: dict, path: tuple, value: object) -> dict:
    parent = state
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return state


@pytest.mark.parametrize(
    ("path", "value", "phrase"),
    [
        # Each reached the internal-error line once the tensors were loaded, or was accepted.
        (("optimizer_param_groups", 0, "betas"), "ab", "optimizer_param_groups[0].betas is a name"),
        (("optimizer_param_groups", 0, "betas"), [0.9], "betas is a list of 1: a number, this"),
        (("optimizer_param_groups", 1, "weight_decay"), None, "[1].weight_decay is null, this"),
        (("optimizer_param_groups", 0, "lr"), "x", "optimizer_param_groups[0].lr is a name"),
        (("optimizer_param_groups", 0, "params"), 3, "[0].params = 3 is not a list of distinct"),
        (("optimizer_param_groups", 0, "eps"), -1.0, "[0].eps = -1.0 is not a hyper-parameter"),
        (("loader", "consumed_samples"), 10**9, "1,000,000,000 leaves the 4 step(s) left"),
        (("loader", "consumed_samples"), 63, "= 63 leaves the 4 step(s) left 31 samples past"),
        (("loader", "components"), {"seed": 1}, "loader.components must be an object of names"),
        (("step",), 10**30, "step = 1000000000000000000000000000000 is not a whole number"),
        (("world_size",), 10**30, "world_size = 1000000000000000000000000000000 is not"),
        (("model_only",), "yes", "model_only = 'yes' is not true or false"),
    ],
)
def test_a_train_state_is_checked_whole_before_anything_is_loaded(run, capsys, path, value, phrase):
    target = step(run, 4) / TRAIN_STATE
    target.write_text(json.dumps(edited(json.loads(target.read_text()), path, value)))
    argv = ["train", run, "checkpoint.verify_checksums=false", "--resume", step(run, 4)]
    assert main([str(a) for a in argv]) == 1
    out, err = capsys.readouterr()
    (line,) = [line for line in err.splitlines() if line.startswith("goodput: error: ")]
    assert str(target) in line and phrase in line and "Traceback" not in err
    assert "resume: from" not in out  # the line a finished load prints


def test_auto_passes_over_a_checkpoint_with_a_broken_train_state(run, capsys):
    (step(run, 8) / TRAIN_STATE).write_text(json.dumps({"step": -1}))
    assert main(["train", str(run)]) == 0
    out = capsys.readouterr().out
    damaged = (
        f"damaged ({step(run, 8) / TRAIN_STATE}: step = -1 is not a whole number in "
        "[0, 1,099,511,627,776])"
    )
    assert f"skipping checkpoint {step(run, 8)}: {damaged}" in out
    assert f"resume: from {step(run, 4)} (step 4)" in out


def train_on_rank(rank, world_size, cfg):
    return train(cfg)


@pytest.mark.parametrize("damaged_file", ["__0_0.distcp", "__1_0.distcp"])
def test_two_ranks_split_the_hashing_and_both_fall_back(tmp_path, capfd, damaged_file):
    # Each rank hashes about half the bytes: whichever rank holds the damaged file in its share,
    # both refuse the checkpoint and resume from the same older one.
    cfg = tiny_run_config(tmp_path)
    cfg = replace(
        cfg,
        train=replace(cfg.train, run_dir=str(tmp_path / "run")),
        checkpoint=replace(cfg.checkpoint, interval_steps=4),
    )
    straight = run_distributed(train_on_rank, 2, cfg)[0]
    root = checkpoints_dir(cfg.train.run_dir)
    sizes = {p.name: p.stat().st_size for p in step_dir(root, 8).glob("*.distcp")}
    assert [sorted(share) for share in assign(sizes, 2)] in (
        [["__0_0.distcp"], ["__1_0.distcp"]],
        [["__1_0.distcp"], ["__0_0.distcp"]],
    )
    flip_a_byte(step_dir(root, 8) / damaged_file)
    capfd.readouterr()
    losses = run_distributed(train_on_rank, 2, cfg)
    out = capfd.readouterr().out
    assert losses[0] == losses[1] == straight[4:]
    assert f"warning: refusing checkpoint {step_dir(root, 8)}: {damaged_file}: checksum" in out
    assert f"resume: from {step_dir(root, 4)} (step 4)" in out


def test_the_hashing_is_split_by_bytes():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 1}
    assert assign(sizes, 2) == [["a", "d"], ["b", "c"]]
    assert assign(sizes, 5) == [["a"], ["b"], ["c"], ["d"], []]


def test_ckpt_list_shows_a_broken_latest_file_instead_of_failing(run, capsys):
    (checkpoints_dir(run_dir(run)) / "latest").write_bytes(b"\xff\xfe" * 10)
    assert main(["ckpt", "list", str(run_dir(run))]) == 0
    out = capsys.readouterr().out
    assert "latest names nothing readable (is not valid UTF-8 text" in out


def test_a_checkpoint_lacking_a_tensor_of_the_model_is_refused_by_name(run, capsys):
    # As a checkpoint of a model whose parameters were renamed since (MoE experts before they
    # became grouped weights) looks: the same config, one tensor name missing.
    metadata = read_metadata(step(run, 8))
    del metadata.state_dict_metadata["model.norm.weight"]
    (step(run, 8) / ".metadata").write_bytes(pickle.dumps(metadata))
    err = one_line_error(
        capsys, "train", run, "checkpoint.verify_checksums=false", "--resume", step(run, 8)
    )
    assert f"{step(run, 8)}: model.norm.weight: this model's tensor is not in the checkpoint" in err
