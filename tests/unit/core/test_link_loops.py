"""A loop of symbolic links given where a command reads or writes is one line naming the loop,
never the internal-error line (Python 3.11's ``Path.resolve`` raises ``RuntimeError`` for one)
and never named as missing (``Path.exists`` and ``is_dir`` say False for one): a corpus file, a
tokenizer, a config, a checkpoint, a run directory, an HF folder, an output path."""

from __future__ import annotations

from pathlib import Path

import pytest

from goodput import cli
from goodput.config import to_toml
from goodput.errors import DEBUG_HINT
from goodput.testing.tiny import tiny_run_config

# What the line says of a loop: the OS's words (io.path_status, io.resolved, every open) or
# the output guard's.
LOOP_SAYS = ("Too many levels of symbolic links", "is a loop of symbolic links")


@pytest.fixture
def loop(tmp_path) -> Path:
    """``loop.jsonl``, a link to itself."""
    link = tmp_path / "loop.jsonl"
    link.symlink_to(link.name)
    return link


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(to_toml(tiny_run_config(tmp_path)))
    return path


def loop_line(capsys, loop: Path, *argv: object) -> str:
    """Run ``goodput ARGV`` in this process: its error, the last stderr line and the only
    error line (notes may come first), which names ``loop``."""
    code = cli.main([str(a) for a in argv])
    lines = capsys.readouterr().err.splitlines()
    err = lines[-1]
    assert code != 0 and err.startswith("goodput: error: "), lines
    assert sum(line.startswith("goodput: error: ") for line in lines) == 1, lines
    assert str(loop) in err and any(says in err for says in LOOP_SAYS), err
    assert DEBUG_HINT not in err
    return err


@pytest.mark.parametrize("command", ["tokenize", "train-tokenizer"])
def test_a_corpus_file(capsys, loop, tmp_path, command):
    options = {"tokenize": ["--tokenizer", loop], "train-tokenizer": ["--vocab-size", 280]}
    out = tmp_path / "out.model"
    loop_line(capsys, loop, "data", command, loop, *options[command], "--output", out)


def test_a_corpus_file_after_a_good_one(capsys, loop, tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text('{"text": "a document"}\n')
    argv = ["data", "tokenize", good, loop, "--tokenizer", tmp_path / "t.model"]
    loop_line(capsys, loop, *argv, "--output", tmp_path / "out")


def test_a_tokenizer_and_an_output_folder(capsys, loop, tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text('{"text": "a document"}\n')
    tokenize = ["data", "tokenize", good, "--tokenizer"]
    err = loop_line(capsys, loop, *tokenize, loop.with_name("t.model"), "--output", loop)
    assert err.startswith(f"goodput: error: --output {loop}: ")
    model = loop.with_name("loop.model")
    model.symlink_to(model.name)
    loop_line(capsys, model, *tokenize, model, "--output", tmp_path / "out")


@pytest.mark.parametrize("option", ["--cache", "--output"])
def test_a_blend_file_list_and_cache(capsys, loop, tmp_path, option):
    blend = ["data", "blend", "--seq-len", 4, "--num-samples", 4, "--seed", 1]
    loop_line(capsys, loop, *blend[:2], loop, *blend[2:], "--cache", tmp_path / "c")
    file_list = tmp_path / "list.txt"
    file_list.write_text("1.0 data x\n")
    if option == "--cache":
        loop_line(capsys, loop, *blend[:2], file_list, *blend[2:], "--cache", loop)


def test_data_verify_and_inspect(capsys, loop):
    loop_line(capsys, loop, "data", "verify", loop)
    index = loop.with_name("shard.idx")  # inspect reads the shard's .idx first
    index.symlink_to(index.name)
    loop_line(capsys, index, "data", "inspect", index)


def test_a_config(capsys, loop):
    loop_line(capsys, loop, "train", loop)


def test_a_checkpoint_to_resume_from(capsys, loop, config):
    err = loop_line(capsys, loop, "train", config, "--resume", loop)
    assert f"{loop}: unreadable (Too many levels of symbolic links)" in err


def test_a_run_directory_to_list(capsys, loop):
    loop_line(capsys, loop, "ckpt", "list", loop)


@pytest.mark.parametrize("command", ["export-hf", "to-torch"])
def test_a_checkpoint_to_export(capsys, loop, tmp_path, command):
    loop_line(capsys, loop, "ckpt", command, loop, tmp_path / "out.pt")


def test_an_hf_folder_and_a_pt_file_to_import(capsys, loop, tmp_path, config):
    loop_line(capsys, loop, "ckpt", "import", loop, "--from", "hf", "--output", tmp_path / "run1")
    loop_line(capsys, loop, "ckpt", "from-torch", loop, config, tmp_path / "run2")


@pytest.mark.parametrize("kind", ["megatron", "megatron-legacy", "deepspeed"])
def test_a_megatron_or_deepspeed_folder_to_import(capsys, loop, tmp_path, config, kind):
    argv = ["ckpt", "import", loop, "--from", kind, "--config", config]
    loop_line(capsys, loop, *argv, "--output", tmp_path / "run")


def test_a_run_directory_output(capsys, loop, tmp_path, config):
    loop_line(capsys, loop, "train", config, f"train.run_dir={loop}")
    loop_line(capsys, loop, "ckpt", "import", tmp_path, "--from", "hf", "--output", loop)


def test_a_dangling_link_where_a_folder_should_be_is_named_as_one(capsys, tmp_path):
    dangling = tmp_path / "out"
    dangling.symlink_to("nowhere")
    good = tmp_path / "a.jsonl"
    good.write_text('{"text": "a document"}\n')
    argv = ["data", "tokenize", good, "--tokenizer", tmp_path / "t.model", "--output", dangling]
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"goodput: error: --output {dangling}: is a link to nothing where a folder should be; "
        "fix the path\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "{loop}"],
        ["report", "{loop}", "--html", "{tmp}/page.html"],
        ["diagnose", "batch-size", "{loop}"],
        ["generate", "{loop}", "--prompt", "hi"],
        ["eval", "{loop}", "--tasks", "x"],
        ["eval", "{tmp}", "--tasks", "x", "--include-path", "{loop}"],
    ],
)
def test_a_run_or_checkpoint_folder_read_by_report_diagnose_generate_eval(
    capsys, loop, tmp_path, argv
):
    loop_line(capsys, loop, *(a.format(loop=loop, tmp=tmp_path) for a in argv))
