"""Tokenizers: both kinds load, encode on one thread, round-trip, and name their identity."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from goodput.data.tokenizer import KINDS, load_tokenizer, train_sentencepiece
from goodput.errors import GoodputError

WORDS = (
    "the of and to in is that for it with as was on be by this are from at or an which "
    "def return class import self None True False if else for while try except lambda"
).split()
ROUND_TRIP_TEXTS = [
    "the class of it is None",
    "def f(x):\n\tif x:  \n        return 'héllo 世界 🙂'\n\n",
    "  leading spaces, trailing spaces  ",
    "digits 1234567890 and symbols ~!@#$%^&*()",
    "",
]


def write_corpus(path, seed=0, num_docs=300):
    rng = np.random.default_rng(seed)
    docs = [
        "\n".join(" ".join(rng.choice(WORDS, size=rng.integers(2, 12))) for _ in range(5)) + "\n"
        for _ in range(num_docs)
    ]
    docs.append("x = [i ** 2 for i in range(10)]  # 0123456789 ünïcödé\n" * 20)
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(scope="module")
def sp_model(corpus):
    return train_sentencepiece([corpus], 400, corpus.parent / "sp.model")


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory):
    """A byte-level BPE tokenizer.json with an <|endoftext|> special token, trained here."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def error_of(function, *args, **kwargs):
    with pytest.raises(GoodputError) as info:
        function(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- SentencePiece ---------------------------------------------------------------------------


def test_sentencepiece_training_is_deterministic(corpus, sp_model, tmp_path):
    again = train_sentencepiece([corpus], 400, tmp_path / "again.model")
    assert again.read_bytes() == sp_model.read_bytes()


def test_sentencepiece_round_trips_any_text(sp_model):
    tokenizer = load_tokenizer(sp_model)
    assert (tokenizer.kind, tokenizer.vocab_size, tokenizer.eod_id) == ("sentencepiece", 400, 2)
    ids = tokenizer.encode_batch(ROUND_TRIP_TEXTS)
    assert [tokenizer.decode(doc) for doc in ids] == ROUND_TRIP_TEXTS
    assert ids[-1] == [] and all(tokenizer.eod_id not in doc for doc in ids)


def test_identity_names_file_hash_and_library(sp_model):
    identity = load_tokenizer(str(sp_model)).identity()
    assert identity == {
        "kind": "sentencepiece",
        "path": str(sp_model),
        "sha256": hashlib.sha256(sp_model.read_bytes()).hexdigest(),
        "library": f"sentencepiece=={sentencepiece.__version__}",
        "vocab_size": 400,
        "eod_id": 2,
    }


def test_identity_changes_with_the_file(corpus, sp_model, tmp_path):
    other = train_sentencepiece([corpus], 350, tmp_path / "other.model")
    assert (
        load_tokenizer(other).identity()["sha256"] != load_tokenizer(sp_model).identity()["sha256"]
    )


def test_model_without_eos_is_refused(corpus, tmp_path):
    path = tmp_path / "no_eos.model"
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(path.with_suffix("")), vocab_size=100, eos_id=-1,
        minloglevel=2,
    )  # fmt: skip
    message = error_of(load_tokenizer, path)
    assert str(path) in message and "no end-of-sequence token" in message


@pytest.mark.parametrize(("vocab_size", "expected"), [(50, "smaller"), (100_000, "too high")])
def test_vocab_size_the_corpus_cannot_support(corpus, tmp_path, vocab_size, expected):
    message = error_of(train_sentencepiece, [corpus], vocab_size, tmp_path / "m.model")
    assert f"--vocab-size {vocab_size}" in message and expected in message


def test_training_reports_bad_input_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    message = error_of(train_sentencepiece, [path], 300, tmp_path / "m.model")
    assert message.startswith(f"{path}:2: malformed JSON")


def test_training_needs_text(tmp_path):
    path = tmp_path / "empty_docs.jsonl"
    path.write_text('{"text": " "}\n')
    assert "no non-empty documents" in error_of(
        train_sentencepiece, [path], 300, tmp_path / "m.model"
    )


def test_training_output_must_be_a_model_file(corpus, tmp_path):
    assert "end in .model" in error_of(train_sentencepiece, [corpus], 300, tmp_path / "m.bin")


# --- HF tokenizers ---------------------------------------------------------------------------


def test_hf_round_trips_without_special_tokens(hf_json):
    tokenizer = load_tokenizer(hf_json)
    raw = tokenizers.Tokenizer.from_file(str(hf_json))
    assert tokenizer.kind == "hf"
    assert tokenizer.eod_id == raw.token_to_id("<|endoftext|>")
    assert tokenizer.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    ids = tokenizer.encode_batch(ROUND_TRIP_TEXTS)
    assert ids == [raw.encode(text, add_special_tokens=False).ids for text in ROUND_TRIP_TEXTS]
    assert [tokenizer.decode(doc) for doc in ids] == ROUND_TRIP_TEXTS
    assert tokenizer.decode([*ids[0], tokenizer.eod_id]) == ROUND_TRIP_TEXTS[0]
    assert tokenizer.identity()["library"] == f"tokenizers=={tokenizers.__version__}"


@pytest.mark.parametrize(("through_goodput", "expect_one_thread"), [(True, True), (False, False)])
def test_hf_encodes_on_one_thread(hf_json, through_goodput, expect_one_thread):
    """Count the process's threads after a batch, in a fresh interpreter: the library starts its
    thread pool on first parallel use. Timing would not tell on a loaded machine; this does. The
    library called directly is the control that shows the check can fail."""
    script = f"""
import os, tokenizers
from goodput.data.tokenizer import load_tokenizer
texts = ["some words to encode"] * 1000
if {through_goodput}:
    load_tokenizer({str(hf_json)!r}).encode_batch(texts)
else:
    tokenizers.Tokenizer.from_file({str(hf_json)!r}).encode_batch_fast(texts)
print(len(os.listdir("/proc/self/task")))
"""
    env = {key: value for key, value in os.environ.items() if key != "TOKENIZERS_PARALLELISM"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert (int(result.stdout) == 1) == expect_one_thread


def test_hf_without_an_end_of_document_token(tmp_path):
    tokenizer = tokenizers.Tokenizer(models.BPE())
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    message = error_of(load_tokenizer, path)
    assert str(path) in message and "<|endoftext|>" in message


# --- loading ---------------------------------------------------------------------------------


def test_kind_from_suffix_or_explicit(sp_model, hf_json, tmp_path):
    assert sorted(KINDS) == ["hf", "sentencepiece"]
    renamed = tmp_path / "tokenizer.bin"
    renamed.write_bytes(hf_json.read_bytes())
    assert load_tokenizer(renamed, "hf").kind == "hf"
    assert "--tokenizer-kind (hf, sentencepiece)" in error_of(load_tokenizer, renamed)
    assert "use one of: hf, sentencepiece" in error_of(load_tokenizer, sp_model, "tiktoken")


@pytest.mark.parametrize("name", ["missing.model", "missing.json"])
def test_missing_file(tmp_path, name):
    path = tmp_path / name
    assert f"{path}: cannot read the tokenizer" in error_of(load_tokenizer, path)


@pytest.mark.parametrize(
    ("name", "expected"), [("bad.model", "SentencePiece"), ("bad.json", "JSON")]
)
def test_corrupt_file(tmp_path, name, expected):
    path = tmp_path / name
    path.write_bytes(b"\x00 definitely not a tokenizer {")
    message = error_of(load_tokenizer, path)
    assert str(path) in message and expected in message


def test_a_model_is_trained_again_over_itself_but_never_over_another_file(corpus, tmp_path):
    model = train_sentencepiece([corpus], 400, tmp_path / "tok.model")
    assert train_sentencepiece([corpus], 400, model) == model  # its own earlier output
    notes = tmp_path / "notes.model"
    notes.write_text("mine")
    for output, message in ((notes, "is not a SentencePiece model"), (corpus, "also reads")):
        with pytest.raises(GoodputError, match=message) as exc:
            train_sentencepiece([corpus], 400, output)
        assert exc.value.render().startswith(f"--output {output}: ")
    assert notes.read_text() == "mine"
