"""A model whose log-likelihoods are known by hand: a character tokenizer and a bigram table,
for the scoring tests of the harness and of ``goodput eval``'s lm-eval model."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from goodput.data.tokenizer import Tokenizer

# P(next | previous) over ids (end of document, " ", "a", "b"), rows by the previous token.
BIGRAM = [
    [0.1, 0.3, 0.3, 0.3],
    [0.1, 0.1, 0.5, 0.3],
    [0.1, 0.2, 0.4, 0.3],
    [0.2, 0.3, 0.1, 0.4],
]


class CharTokenizer(Tokenizer):
    """One id per character of ``alphabet``, from 1; id 0 is the end of document."""

    kind = "chars"

    def __init__(self, alphabet: str = " ab"):
        self.alphabet = alphabet
        self.path, self.sha256, self.library = Path("chars"), "", "test"
        self.vocab_size, self.eod_id = len(alphabet) + 1, 0

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[1 + self.alphabet.index(char) for char in text] for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.alphabet[i - 1] for i in ids if i)


class BigramModel(nn.Module):
    """Logits = log P(next | this token): the log-probabilities are the table's own; ``cfg``
    has the fields scorers read; ``seen_modes`` records (training, grad enabled) per forward."""

    def __init__(self, max_seq_len: int = 64):
        super().__init__()
        self.table = nn.Parameter(torch.tensor(BIGRAM, dtype=torch.float64).log().float())
        self.cfg = SimpleNamespace(max_seq_len=max_seq_len, vocab_size=len(BIGRAM))
        self.seen_modes: list[tuple[bool, bool]] = []

    def forward(self, ids_bt: torch.Tensor) -> torch.Tensor:
        self.seen_modes.append((self.training, torch.is_grad_enabled()))
        return self.table[ids_bt]
