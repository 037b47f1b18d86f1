"""`goodput ckpt export-hf` writes the tokenizer: transformers.AutoTokenizer loads the folder
offline and encodes exactly goodput's ids, for a real SentencePiece model the run's blend pins and
for a tokenizers BPE passed with --tokenizer; the refusals are one line and write nothing."""

import json
import os
import shutil
from dataclasses import replace

import pytest

from goodput.cli import main
from goodput.data.tokenizer import load_tokenizer
from goodput.testing.tiny import TINY_MODEL, TOKENIZED_WORDS, tokenized_run_config
from goodput.train.convert.checkpoints import (
    load_model_state,
    read_model_config,
    write_model_only_checkpoint,
)
from goodput.train.loop import train
from goodput.train.model import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TEXTS = [
    "alpha beta gamma",
    " alpha  beta",
    "   leading spaces and trailing   ",
    "new\nline\n\n\nthree\r\n",
    "\ttabbed\tdelta",
    "héllo wörld, naïve café 😀 日本語",
    "digits 1234567890 and x9",
    "a literal </s> and <s> and <unk>",
    "▁ already a metaspace",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run trained on shards tokenized with a real SentencePiece model (its blend pins
    it); the model's vocabulary (320) is padded past the tokenizer's (300)."""
    root = tmp_path_factory.mktemp("export")
    cfg, tokenizer = tokenized_run_config(root)
    cfg = replace(
        cfg,
        train=replace(cfg.train, steps=2),
        checkpoint=replace(cfg.checkpoint, interval_steps=2, async_save=False),
    )
    train(cfg)
    return root / "tiny" / "run" / "checkpoints" / "step-00000002", tokenizer


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def export(capsys, *argv):
    code = main(["ckpt", "export-hf", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def assert_encodes_as_goodput(out, tokenizer_file):
    from transformers import AutoTokenizer

    ours = load_tokenizer(tokenizer_file)
    theirs = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = ours.encode_batch([text])[0]
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.encode(text) == ids, text
        assert theirs.decode(ids) == ours.decode(ids), text
        # SentencePiece's own escape character is the one thing it does not give back.
        assert ours.decode(ids) == text or "▁" in text, text
    assert theirs.eos_token_id == ours.eod_id
    return theirs


def test_a_sentencepiece_export_encodes_as_goodput_and_loads(run, capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    step, tokenizer_file = run
    out = tmp_path / "hf"
    code, stdout, _ = export(capsys, step, out)
    assert code == 0 and "HuggingFace Llama folder written" in stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    assert (out / "tokenizer.model").read_bytes() == tokenizer_file.read_bytes()
    theirs = assert_encodes_as_goodput(out, tokenizer_file)
    assert (theirs.bos_token, theirs.eos_token, theirs.unk_token) == ("<s>", "</s>", "<unk>")
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.eos_token_id == 2 and model.config.vocab_size == 320


def test_a_tokenizers_json_passed_with_tokenizer_encodes_as_goodput(run, capsys, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    step, _ = run
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([" ".join(TOKENIZED_WORDS)] * 50 + TEXTS, trainer)
    # A template that adds BOS: goodput never does, so the export must not either.
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))]
    )
    tokenizer_file = tmp_path / "tokenizer.json"
    bpe.save(str(tokenizer_file))
    out = tmp_path / "hf"
    assert export(capsys, step, out, "--tokenizer", tokenizer_file)[0] == 0
    assert "tokenizer.json" in os.listdir(out) and "tokenizer.model" not in os.listdir(out)
    texts_without_specials = [t for t in TEXTS if "<" not in t]
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(tokenizer_file), AutoTokenizer.from_pretrained(out)
    for text in texts_without_specials:
        ids = ours.encode_batch([text])[0]
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.decode(ids) == ours.decode(ids) == text, text
    # Special tokens in text: both go through the tokenizers library's added vocabulary.
    assert theirs("a </s> b")["input_ids"] == ours.encode_batch(["a </s> b"])[0]
    assert theirs.eos_token == "</s>" and theirs.eos_token_id == ours.eod_id
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (None, ours.eod_id)


def assert_refused(capsys, tmp_path, argv, code, *phrases):
    out = tmp_path / "hf"
    found, _, err = export(capsys, *argv[:1], out, *argv[1:])
    assert found == code
    assert err.startswith("goodput: error: ") and err.count("\n") == 1, err
    for phrase in phrases:
        assert phrase in err, err
    assert not out.exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")] == []


def test_a_model_only_checkpoint_needs_tokenizer(run, capsys, tmp_path):
    step, tokenizer_file = run
    cfg = read_model_config(step)
    imported = write_model_only_checkpoint(
        tmp_path / "imported", load_model_state(step, cfg).items(), cfg
    )
    capsys.readouterr()
    assert_refused(capsys, tmp_path, [imported], 2, "model-only", "--tokenizer")
    assert export(capsys, imported, tmp_path / "hf", "--tokenizer", tokenizer_file)[0] == 0
    assert_encodes_as_goodput(tmp_path / "hf", tokenizer_file)


def test_a_moved_or_changed_tokenizer_says_to_pass_tokenizer(run, capsys, tmp_path):
    step, tokenizer_file = run
    original = tokenizer_file.read_bytes()
    moved = tmp_path / "elsewhere.model"
    try:
        shutil.move(tokenizer_file, moved)
        assert_refused(capsys, tmp_path, [step], 1, "missing", "--tokenizer")
        tokenizer_file.write_bytes(original + b"\0")
        assert_refused(capsys, tmp_path, [step], 1, "changed since the blend pinned it")
    finally:
        tokenizer_file.write_bytes(original)
        moved.unlink(missing_ok=True)


def test_a_tokenizer_larger_than_the_model_is_refused(run, capsys, tmp_path):
    _, tokenizer_file = run
    small = write_model_only_checkpoint(
        tmp_path / "small", Transformer(TINY_MODEL).state_dict().items(), TINY_MODEL
    )
    capsys.readouterr()
    argv = [small, "--tokenizer", tokenizer_file]
    assert_refused(capsys, tmp_path, argv, 2, "vocabulary (300) is larger than the model's (61)")
