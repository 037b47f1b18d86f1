"""Tokenize end to end with real tokenizers, real worker processes and a really killed job."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from goodput import cli
from goodput.data import tokenize
from goodput.data.shards import ShardReader
from goodput.data.tokenizer import load_tokenizer, train_sentencepiece
from goodput.errors import GoodputError

WORDS = [
    *"alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split(),
    *"pi rho sigma tau upsilon phi chi psi omega def return class import".split(),
]


def documents(seed, count):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(3, 60))) + "\n" for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Twelve JSONL files in a folder, and a SentencePiece model trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    folder = root / "web"
    folder.mkdir()
    texts = []
    for f in range(12):
        docs = documents(f, 40)
        texts += docs
        (folder / f"part{f:02d}.jsonl").write_text(
            "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
        )
    model = train_sentencepiece(sorted(folder.iterdir()), 300, root / "tok.model")
    return folder, model, texts


def job(folder, model, output, **overrides):
    values = {
        "inputs": [folder],
        "tokenizer": model,
        "tokenizer_kind": None,
        "output": output,
        "name": "web",
        "num_workers": 1,
        "shard_size_mb": 0.004,
        "text_field": "text",
        "pack_seq_len": None,
    }
    return tokenize.TokenizeJob(**{**values, **overrides})


def dataset_bytes(output):
    return {p.name: p.read_bytes() for p in sorted(output.iterdir()) if p.is_file()}


def test_documents_end_in_a_counted_eod_and_match_the_tokenizer(corpus, tmp_path):
    folder, model, texts = corpus
    manifest = tokenize.run(job(folder, model, tmp_path))
    tok = load_tokenizer(model)
    assert len(manifest["shards"]) > 3 and manifest["dtype"] == "uint16"
    assert manifest["num_documents"] == len(texts)
    assert manifest["tokenizer"]["sha256"] == tok.identity()["sha256"]
    docs = [d for s in manifest["shards"] for d in ShardReader(tmp_path / s["shard"])]
    expected = tok.encode_batch(texts)
    for doc, ids in zip(docs, expected, strict=True):
        assert doc[-1] == tok.eod_id and doc[:-1].tolist() == ids
    assert manifest["num_tokens"] == sum(len(ids) + 1 for ids in expected)


def test_output_does_not_depend_on_workers_or_ranks(corpus, tmp_path):
    folder, model, _ = corpus
    tokenize.run(job(folder, model, tmp_path / "one"))
    tokenize.run(job(folder, model, tmp_path / "two", num_workers=2))
    assert tokenize.run(job(folder, model, tmp_path / "ranks", rank=1, world_size=2)) is None
    assert not (tmp_path / "ranks" / "web.manifest.json").exists()
    tokenize.run(job(folder, model, tmp_path / "ranks", rank=0, world_size=2))
    one = dataset_bytes(tmp_path / "one")
    assert dataset_bytes(tmp_path / "two") == one == dataset_bytes(tmp_path / "ranks")


def test_a_killed_job_resumes_to_the_same_bytes(corpus, tmp_path):
    folder, model, _ = corpus
    tokenize.run(job(folder, model, tmp_path / "reference"))
    output = tmp_path / "killed"
    command = [
        sys.executable,
        "-m",
        "goodput.cli",
        "data",
        "tokenize",
        str(folder),
        "--tokenizer",
        str(model),
        "--output",
        str(output),
        "--name",
        "web",
        "--workers",
        "1",
        "--shard-size-mb",
        "0.004",
    ]
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(list((output / ".parts").glob("*.json"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)  # the job and its worker, mid-flight
    process.wait()
    done_before = sorted(p.name for p in (output / ".parts").glob("*.json"))
    assert done_before and not (output / "web.manifest.json").exists()
    stamps = {p: p.stat().st_mtime_ns for p in output.glob("web_*.bin")}
    # Damage a finished shard behind its record's back: it must be redone, not trusted.
    first = output / "web_00000.bin"
    first.write_bytes(first.read_bytes()[:-2])
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "resuming" in result.stderr
    assert dataset_bytes(output) == dataset_bytes(tmp_path / "reference")
    untouched = [p for p in stamps if p != first and p.stat().st_mtime_ns == stamps[p]]
    assert len(untouched) >= len(done_before) - 1  # finished shards were skipped, not redone
    assert not list(output.glob(".*.tmp"))


def test_packed_rows(corpus, tmp_path):
    folder, model, _ = corpus
    manifest = tokenize.run(job(folder, model, tmp_path, pack_seq_len=31, shard_size_mb=1))
    reader = ShardReader(tmp_path / manifest["shards"][0]["shard"])
    assert set(reader.document_lengths.tolist()) == {32}
    unpacked = tokenize.run(job(folder, model, tmp_path / "plain", shard_size_mb=1))
    stream = np.concatenate(list(ShardReader(tmp_path / "plain" / "web_00000")))
    assert np.array_equal(np.concatenate(list(reader)), stream[: len(reader) * 32])
    assert manifest["num_tokens_dropped"] == unpacked["num_tokens"] - reader.num_tokens < 32


def test_hf_tokenizer_with_a_big_vocab_writes_int32(corpus, tmp_path):
    folder, _, texts = corpus
    vocab = {"[UNK]": 0, "<|endoftext|>": 1} | {w: i + 2 for i, w in enumerate(WORDS)}
    vocab |= {f"filler{i}": len(vocab) + i for i in range(70000)}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<|endoftext|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    manifest = tokenize.run(
        job(folder, tmp_path / "tokenizer.json", tmp_path / "out", shard_size_mb=1)
    )
    reader = ShardReader(tmp_path / "out" / "web_00000")
    assert manifest["dtype"] == "int32" and reader.dtype == np.int32
    assert reader[0].tolist() == [vocab[w] for w in texts[0].split()] + [1]


def blend_list(directory, *, seq_len, num_samples):
    """Blend ``directory/list.txt`` with seed 0 into ``directory/cache``."""
    from goodput.data.blend import BlendSpec, BlendStage, build_blend

    return build_blend(
        BlendSpec(
            stages=(BlendStage(directory / "list.txt", 0),),
            seq_len=seq_len,
            num_samples=num_samples,
            seed=0,
            cache=directory / "cache",
        )
    )


def run_cli(*argv):
    try:
        return cli.main([str(a) for a in argv])
    except SystemExit as exc:  # argparse refuses a bad option value itself, with exit 2
        return exc.code


def test_bad_inputs_fail_in_one_line_and_leave_earlier_output(corpus, tmp_path, capsys):
    folder, model, _ = corpus
    out = tmp_path / "out"
    assert run_cli("data", "tokenize", folder, "--tokenizer", model, "--output", out) == 0
    before = dataset_bytes(out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    capsys.readouterr()
    assert run_cli("data", "tokenize", bad, "--tokenizer", model, "--output", out) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{bad}:2" in err and "malformed JSON" in err
    assert not (out / "bad.manifest.json").exists()
    for path, message in ((tmp_path / "missing.jsonl", "missing"), (tmp_path / "x.csv", "csv")):
        if message == "csv":
            path.write_text("a,b\n")
        assert run_cli("data", "tokenize", path, "--tokenizer", model, "--output", out) != 0
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and str(path.name) in err
    # A different job under an existing dataset's name is refused, the dataset kept.
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.jsonl").write_text('{"text": "something else"}\n')
    assert (
        run_cli("data", "tokenize", other, "--tokenizer", model, "--output", out, "--name", "web")
        == 1
    )
    assert "built from other inputs" in capsys.readouterr().err
    assert dataset_bytes(out) == before


def test_inspect_and_verify_catch_a_changed_shard(corpus, tmp_path, capsys):
    folder, model, _ = corpus
    tokenize.run(job(folder, model, tmp_path, shard_size_mb=1))
    assert run_cli("data", "inspect", tmp_path / "web_00000.bin", "--tokenizer", model) == 0
    out = capsys.readouterr().out
    assert "480 documents" in out and "checksums: ok" in out and "alpha" in out or "beta" in out
    assert run_cli("data", "verify", tmp_path / "web.manifest.json") == 0
    data = bytearray((tmp_path / "web_00000.bin").read_bytes())
    data[10] ^= 1
    (tmp_path / "web_00000.bin").write_bytes(bytes(data))
    capsys.readouterr()
    assert run_cli("data", "inspect", tmp_path / "web_00000", "--json") == 1
    assert json.loads(capsys.readouterr().out)["problems"] == [
        f"{tmp_path / 'web_00000.bin'}: checksum mismatch (the file changed since it was pinned)"
    ]
    assert run_cli("data", "verify", tmp_path / "web.manifest.json") == 1
    assert "web_00000.bin: checksum mismatch" in capsys.readouterr().err


def test_blend_of_packed_shards_reads_rows(corpus, tmp_path):
    from goodput.data.loader import BlendedSamples

    folder, model, _ = corpus
    tokenize.run(job(folder, model, tmp_path, pack_seq_len=15, shard_size_mb=1))
    (tmp_path / "list.txt").write_text("1 web_00000 web\n")
    directory, manifest = blend_list(tmp_path, seq_len=15, num_samples=50)
    rows = {tuple(r.tolist()) for r in ShardReader(tmp_path / "web_00000")}
    samples = BlendedSamples(directory)
    assert all(tuple(samples[i].tolist()) in rows for i in range(50))
    assert not (tmp_path / "cache" / "files").exists()  # no per-file index for packed shards
    with pytest.raises(GoodputError, match="packed for seq_len 15"):
        blend_list(tmp_path, seq_len=16, num_samples=50)


def test_help_is_useful(capsys):
    for argv in (
        ["--help"],
        ["data", "--help"],
        ["data", "tokenize", "--help"],
        ["data", "blend", "--help"],
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 0
    assert "--pack-seq-len" in capsys.readouterr().out


def test_cli_entry_point_installed():
    bin_dir = Path(sys.executable).parent
    result = subprocess.run(
        [str(bin_dir / "goodput"), "--version"], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("goodput ")


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--workers", "0"], {}, "argument --workers: 0 is not in [1,"),
        (["--shard-size-mb", "-1"], {}, "argument --shard-size-mb: -1 is not in (0, 315360000]"),
        (["--pack-seq-len", "0"], {}, "argument --pack-seq-len: 0 is not in [1,"),
        ([], {"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 is outside a world of 2"),
        ([], {"RANK": "x"}, "are not integers"),
    ],
)
def test_bad_job_settings_are_usage_errors(
    corpus, tmp_path, monkeypatch, capsys, argv, env, message
):
    folder, model, _ = corpus
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = run_cli("data", "tokenize", folder, "--tokenizer", model, "--output", tmp_path, *argv)
    assert code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


class OverflowingTokenizer:
    """A tokenizer whose ids exceed the vocab it claims: a broken tokenizer file."""

    eod_id = 0

    def encode_batch(self, texts):
        return [[70000] for _ in texts]


def test_token_ids_beyond_the_shard_dtype_are_refused():
    encoder = tokenize._Encoder(OverflowingTokenizer(), np.dtype(np.uint16), None)
    with pytest.raises(GoodputError, match=r"a.jsonl: a token id does not fit uint16"):
        encoder.encode(["text"], Path("a.jsonl"))


def test_blend_refuses_shards_of_two_tokenizers(corpus, tmp_path):
    folder, model, _ = corpus
    other = tmp_path / "other.model"
    train_sentencepiece(sorted(folder.iterdir())[:3], 320, other)
    tokenize.run(job(folder, model, tmp_path, name="a", shard_size_mb=1))
    tokenize.run(job(folder, other, tmp_path, name="b", shard_size_mb=1))
    (tmp_path / "list.txt").write_text("1 a_00000 web\n1 b_00000 web\n")
    with pytest.raises(GoodputError, match="different tokenizer") as exc:
        blend_list(tmp_path, seq_len=8, num_samples=10)
    assert exc.value.render().startswith(f"{tmp_path / 'list.txt'}:2:")
    assert f"{tmp_path / 'list.txt'}:1" in exc.value.render()


@pytest.mark.parametrize("name", ["../sentinel", "../x", "sub/x", "..", ".hidden", "", "a\0b"])
def test_an_unsafe_name_is_refused_before_anything_is_written(corpus, tmp_path, capsys, name):
    folder, model, _ = corpus
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("keep")
    out = tmp_path / "out"
    argv = ["data", "tokenize", folder, "--tokenizer", model, "--output", out, "--name", name]
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("goodput: error: --name: ") and err.count("\n") == 1
    assert "is not a plain name" in err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "sentinel",
        "sentinel/keep.txt",
    ]


def test_an_unsafe_default_name_is_refused_too(corpus, tmp_path, capsys):
    _, model, _ = corpus
    hidden = tmp_path / ".notes.jsonl"
    hidden.write_text('{"text": "x"}\n')
    assert run_cli("data", "tokenize", hidden, "--tokenizer", model, "--output", tmp_path) == 2
    assert "--name: '.notes' is not a plain name" in capsys.readouterr().err


def test_an_input_reached_twice_is_tokenized_once(corpus, tmp_path):
    folder, model, texts = corpus
    first = sorted(folder.iterdir())[0]
    (tmp_path / "link.jsonl").symlink_to(first)
    os.link(first, tmp_path / "hard.jsonl")
    inputs = [folder, tmp_path / "link.jsonl", tmp_path / "hard.jsonl", first]
    manifest = tokenize.run(job(folder, model, tmp_path / "out", inputs=inputs))
    assert manifest["num_documents"] == len(texts)


def test_a_units_temp_files_from_a_killed_attempt_go_and_lookalikes_stay(corpus, tmp_path):
    """What a worker killed mid-write leaves (atomic_path's temp files of the unit's .bin, .idx
    and part record) is removed when the unit is tokenized again; a folder or another length by
    such a name is not goodput's and stays."""
    folder, model, _ = corpus
    output = tmp_path / "out"
    (output / tokenize.PARTS_DIR).mkdir(parents=True)
    killed = [
        output / ".web_00000.bin.k1lled00.tmp",
        output / ".web_00000.idx.k1lled01.tmp",
        output / tokenize.PARTS_DIR / ".web_00000.json.k1lled02.tmp",
    ]
    for path in killed:
        path.write_bytes(b"half")
    lookalikes = [output / ".web_00000.bin.folder00.tmp", output / ".web_00000.bin.k1lled003.tmp"]
    lookalikes[0].mkdir()
    lookalikes[1].write_bytes(b"not mkstemp's")
    tokenize.run(job(folder, model, output))
    assert not [path for path in killed if path.exists()]
    assert all(path.exists() for path in lookalikes)
