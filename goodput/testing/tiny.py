"""A tiny model, a global batch with uneven target counts, and a complete tiny run on a learnable
corpus: shared by tests and benchmarks."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from goodput.data.shards import ShardWriter
from goodput.train.config.model import ModelConfig
from goodput.train.config.parallel import ParallelConfig
from goodput.train.config.run import DataConfig, RunConfig, TrainConfig
from goodput.train.config.schedule import ScheduleConfig
from goodput.train.loss import IGNORE_INDEX

TINY_MODEL = ModelConfig(
    vocab_size=61, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64
)


def uneven_global_batch(
    num_rows: int = 8, seq_len: int = 12, vocab_size: int = 61
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) where row r keeps only r + 1 targets: a per-row or per-micro-batch mean
    of the loss differs from the token mean, so a wrong reduction shows."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab_size, (num_rows, seq_len + 1), generator=generator)
    labels = tokens[:, 1:].clone()
    for row in range(num_rows):
        labels[row, row + 1 :] = IGNORE_INDEX
    return tokens[:, :-1], labels


def rank_micro_batches(
    inputs: torch.Tensor, labels: torch.Tensor, rank: int, world_size: int, accumulation: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's contiguous slice of the global batch, cut into micro-batches."""
    per_rank = len(inputs) // world_size
    size = per_rank // accumulation
    start = rank * per_rank
    return [
        (
            inputs[start + i * size : start + (i + 1) * size],
            labels[start + i * size : start + (i + 1) * size],
        )
        for i in range(accumulation)
    ]


def write_counting_corpus(prefix: Path, num_docs: int = 200, vocab: int = 61) -> None:
    """Documents that count upward mod (vocab - 1) by a per-document stride: learnable in a few
    steps, so a falling loss shows the loop trains. Token 0 is the EOD."""
    rng = np.random.default_rng(0)
    docs = []
    for _ in range(num_docs):
        start, stride, length = rng.integers(0, vocab - 1), rng.integers(1, 4), rng.integers(8, 80)
        docs.append(np.append(1 + (start + stride * np.arange(length)) % (vocab - 1), 0))
    writer = ShardWriter(prefix, np.dtype(np.uint16))
    writer.add_documents(np.concatenate(docs).astype(np.uint16), np.array([len(d) for d in docs]))
    writer.finish()


def write_random_corpus(
    directory: Path, *, vocab_size: int, num_docs: int, lengths: tuple[int, int], seed: int = 0
) -> Path:
    """Random documents of ``lengths`` [low, high) tokens (content does not change the compute:
    benchmarks) as one shard set, and the file list naming it; return the file list."""
    rng = np.random.default_rng(seed)
    doc_lengths = rng.integers(*lengths, num_docs)
    tokens = rng.integers(1, vocab_size, int(doc_lengths.sum())).astype(np.uint16)
    tokens[np.cumsum(doc_lengths) - 1] = 0  # each document ends with the EOD token
    writer = ShardWriter(directory / "random", np.dtype(np.uint16))
    writer.add_documents(tokens, doc_lengths)
    writer.finish()
    file_list = directory / "file_list.txt"
    file_list.write_text(f"1.0 {directory / 'random'} random\n")
    return file_list


def tiny_run_config(directory: Path) -> RunConfig:
    """A complete tiny run under ``directory``: 8 steps of 8 samples x 16 tokens, fp32 so that
    ranks compare exactly; the run directory is ``directory/run``."""
    data = directory / "data"
    data.mkdir()
    write_counting_corpus(data / "counting")
    (data / "list.txt").write_text("1.0 counting counting\n")
    return RunConfig(
        model=replace(TINY_MODEL, max_seq_len=64),
        train=TrainConfig(
            steps=8,
            tokens_per_step=128,
            seq_len=16,
            micro_batch_size=2,
            run_dir=str(directory / "run"),
            peak_tflops=1.0,
        ),
        data=DataConfig(file_list=str(data / "list.txt"), cache=str(directory / "cache")),
        schedule=ScheduleConfig(lr=1e-2, warmup_steps=2),
        parallel=ParallelConfig(precision="fp32"),
    )


TOKENIZED_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def tokenized_run_config(directory: Path) -> tuple[RunConfig, Path]:
    """``tiny_run_config`` on shards tokenized with a real 300-piece SentencePiece model (the
    blend pins it), the model's vocabulary (320) padded past the tokenizer's; and the
    tokenizer file. For what reads a run's tokenizer back (generation, HF export)."""
    from goodput.data import tokenize
    from goodput.data.tokenizer import train_sentencepiece

    corpus = directory / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = TOKENIZED_WORDS
    docs = [" ".join(rng.choice(words, size=rng.integers(5, 40))) + "\n" for _ in range(150)]
    (corpus / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer = train_sentencepiece([corpus / "docs.jsonl"], 300, directory / "tok.model")
    shards = directory / "shards"
    job = tokenize.TokenizeJob(
        inputs=[corpus],
        tokenizer=tokenizer,
        tokenizer_kind=None,
        output=shards,
        name="docs",
        num_workers=1,
        shard_size_mb=64,
        text_field="text",
        pack_seq_len=None,
    )
    manifest = tokenize.run(job)
    assert manifest is not None
    file_list = directory / "list.txt"
    file_list.write_text("".join(f"1.0 {shards / s['shard']} docs\n" for s in manifest["shards"]))
    (directory / "tiny").mkdir()
    cfg = tiny_run_config(directory / "tiny")
    cfg = replace(
        cfg,
        model=replace(cfg.model, vocab_size=320),
        data=replace(cfg.data, file_list=str(file_list)),
    )
    return cfg, tokenizer


def write_spelling_task(path: Path) -> Path:
    """A multiple-choice task (hellaswag layout) a run of ``tokenized_run_config`` learns in a
    few steps: which of a word and two scrambles of it follows two words."""
    words = TOKENIZED_WORDS
    lines = [
        json.dumps({"ctx": f"{a} {b}", "endings": [c, c[::-1], c[1:] + c[0]], "label": 0})
        for a, b, c in zip(words, words[1:], words[2:], strict=False)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path
