"""Every OS-error shape a data command can meet is one line, a non-zero exit and no traceback:
a folder where a file should be, a file where a folder should be, an existing file in the way,
and permission denied (with root's override of file modes dropped when the tests run as root)."""

from pathlib import Path

import numpy as np
import pytest

from goodput import cli
from goodput.data.shards import ShardWriter
from goodput.data.tokenizer import train_sentencepiece
from goodput.testing.unprivileged import run_goodput


def one_line_error(capsys, *argv):
    """Run ``goodput ARGV`` in this process: (exit code, its one stderr line)."""
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert err.startswith("goodput: error: ") and err.count("\n") == 1, err
    return code, err.strip()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    corpus = root / "a.jsonl"
    corpus.write_text("".join(f'{{"text": "word{i} and more words {i}"}}\n' for i in range(200)))
    return train_sentencepiece([corpus], 280, root / "t.model"), corpus


@pytest.fixture
def places(tmp_path):
    file = tmp_path / "file"
    file.write_text("a file")
    folder = tmp_path / "folder.manifest.json"  # a folder with a file's name
    folder.mkdir()
    return file, folder


def test_tokenize(capsys, places, tokenizer):
    file, folder = places
    model, corpus = tokenizer
    tokenize = ["data", "tokenize", corpus, "--tokenizer"]
    _, err = one_line_error(capsys, *tokenize, model, "--output", file)
    assert f"--output {file}: is a file where a folder should be" in err
    _, err = one_line_error(capsys, *tokenize, model, "--output", file / "sub")
    assert f"{file} is a file where a folder should be" in err
    _, err = one_line_error(capsys, *tokenize, folder, "--output", folder.parent / "out")
    assert f"{folder}: cannot read the tokenizer: is a folder, not a regular file" in err


@pytest.mark.parametrize("command", ["tokenize", "train-tokenizer"])
def test_a_corpus_line_nested_too_deeply_is_one_line(capsys, tokenizer, tmp_path, command):
    model, _ = tokenizer
    corpus = tmp_path / "deep.jsonl"
    corpus.write_text('{"text": "a document"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    options = {"tokenize": ["--tokenizer", model], "train-tokenizer": ["--vocab-size", 280]}
    _, err = one_line_error(
        capsys, "data", command, corpus, *options[command], "--output", tmp_path / "out.model"
    )
    assert err == f"goodput: error: {corpus}:2: is JSON nested too deeply; fix or remove the line"


def test_blend(capsys, places, tmp_path):
    file, folder = places
    blend = ["--seq-len", 4, "--num-samples", 4, "--seed", 1, "--cache"]
    _, err = one_line_error(capsys, "data", "blend", folder, *blend, tmp_path / "c")
    assert f"{folder}: is a folder, not a regular file; pass a regular file" in err
    _, err = one_line_error(capsys, "data", "blend", file, *blend, file / "cache")
    assert f"--cache {file / 'cache'}: {file} is a file where a folder should be" in err
    # The old spelling --output still reaches --cache, with one deprecation line first.
    assert cli.main([str(a) for a in ["data", "blend", file, *blend[:-1], "--output", file]]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning == "goodput: warning: --output is deprecated; use --cache"
    assert error.startswith(f"goodput: error: --cache {file}: ")


def test_inspect_and_verify(capsys, places, tmp_path):
    file, folder = places
    _, err = one_line_error(capsys, "data", "inspect", folder)
    assert f"{folder}: is a folder, not a regular file" in err
    _, err = one_line_error(capsys, "data", "inspect", tmp_path)
    assert f"{tmp_path}.idx: missing" in err
    _, err = one_line_error(capsys, "data", "verify", tmp_path)
    assert f"{tmp_path / 'blend.json'}: No such file or directory" in err
    _, err = one_line_error(capsys, "data", "verify", file)
    assert f"{file}: is not valid JSON" in err


def test_train_tokenizer_and_demo_corpus(capsys, places, tokenizer):
    file, folder = places
    _, corpus = tokenizer
    train = ["data", "train-tokenizer", corpus, "--vocab-size", 280, "--output"]
    _, err = one_line_error(capsys, *train, folder)
    assert f"--output {folder}: is a folder, not a file" in err
    _, err = one_line_error(capsys, *train, file / "t.model")
    assert f"{file} is a file where a folder should be" in err
    _, err = one_line_error(capsys, "data", "demo-corpus", "--output", file)
    assert f"--output {file}: is a file where a folder should be" in err
    (folder.parent / "demo").mkdir()
    (folder.parent / "demo" / "code").write_text("in the way")  # where a domain folder goes
    _, err = one_line_error(capsys, "data", "demo-corpus", "--output", folder.parent / "demo")
    assert f"{folder.parent / 'demo' / 'code'}: File exists; remove it or choose another" in err


def without_override(*argv):
    """``python -m goodput ARGV`` for which file modes hold, even when tests run as root:
    (exit code, its one stderr line)."""
    result = run_goodput(*argv)
    err = result.stderr
    assert result.returncode != 0 and "Traceback" not in err
    assert err.startswith("goodput: error: ") and err.count("\n") == 1, err
    return result.returncode, err.strip()


def test_permission_denied_is_one_line(tmp_path):
    locked = tmp_path / "locked.txt"
    locked.write_text("1 a a\n")
    locked.chmod(0)
    blend = ["--seq-len", 4, "--num-samples", 4, "--seed", 1]
    _, err = without_override("data", "blend", locked, *blend, "--cache", tmp_path / "c")
    assert f"{locked}: Permission denied; check the permissions" in err

    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    (tmp_path / "list.txt").write_text("1 a a\n")
    _, err = without_override("data", "blend", tmp_path / "list.txt", *blend, "--cache", read_only)
    assert f"permission denied: cannot write into {read_only}" in err

    shard = tmp_path / "s"
    writer = ShardWriter(shard, np.dtype(np.uint16))
    writer.add_documents(np.array([1, 0], np.uint16), np.array([2]))
    writer.finish()
    Path(f"{shard}.idx").chmod(0)
    _, err = without_override("data", "inspect", shard)
    assert f"{shard}.idx: Permission denied" in err

    (tmp_path / "blend.json").write_text("{}")
    (tmp_path / "blend.json").chmod(0)
    _, err = without_override("data", "verify", tmp_path / "blend.json")
    assert f"{tmp_path / 'blend.json'}: Permission denied" in err

    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "a.jsonl").chmod(0)
    train = ["data", "train-tokenizer", tmp_path / "a.jsonl", "--vocab-size", 300, "--output"]
    _, err = without_override(*train, tmp_path / "t.model")
    assert f"{tmp_path / 'a.jsonl'}: permission denied" in err
