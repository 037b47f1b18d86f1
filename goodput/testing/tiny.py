"""A tiny model and a global batch with uneven target counts, shared by tests and benchmarks."""

from __future__ import annotations

import torch

from goodput.train.model import ModelConfig
from goodput.train.step import IGNORE_INDEX

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
