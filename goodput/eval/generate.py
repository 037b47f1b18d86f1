"""Text generation from a checkpoint, for a quick look at what a model has learned.

Owns ``generate`` (a model and prompt ids -> new ids, with a KV cache), ``choose_token``
(greedy or seeded top-p sampling), ``check_prompt``, ``CachedDecoder`` (prefill, then one
position per token) and ``generate_from_checkpoint``, what ``goodput generate`` calls (the
checkpoint and tokenizer found and loaded by ``goodput.eval.inference``, shared with
``goodput eval``).

Decoding. The prompt runs once as a whole (prefill), filling the model's ``KVCache``; each new
token then runs alone at the next position, so RoPE sees the positions a full forward would.
Generation stops at the end-of-document token (not part of the result), after
``max_new_tokens``, when prompt plus new tokens fill ``model.max_seq_len``, or when the caller's
``stop`` says so of the new tokens (lm-eval's stop strings); ``stopped`` says which
(``max_new_tokens`` when both limits are reached at once). Temperature 0 is argmax (ties:
the lowest id); otherwise softmax(logits / T), cut to the smallest set of most likely tokens
whose mass reaches ``top_p``, sampled with a ``torch.Generator`` seeded by ``seed``. Sampling
runs on the CPU in fp64, so a seed gives the same tokens for the same logits on any device.
It is computed from the largest logit down, exp((logit - max) / T): every weight is in
[0, 1] and the most likely token's is exactly 1, so every finite T > 0 works (a T far below
the gaps between logits is greedy in effect, equal logits sampled evenly; a huge T is uniform)
and so does every top_p in (0, 1] (the most likely token is always kept). A NaN or +inf logit
(broken weights) is refused, naming the checkpoint's model.
A model vocabulary larger than the tokenizer's (padded) never yields the ids past it.
The prompt must be text a tokenizer takes: a ``--prompt`` that is not UTF-8 (a shell passes
bytes it cannot decode as lone surrogates) is refused, naming the first bad byte.

Loading (``goodput.eval.inference``): a checkpoint or run directory, in the compute dtype of its
precision policy; whole in one process, or sharded over the ranks of a ``goodput launch``, where
every rank decodes the same tokens (each forward is a collective) and rank 0 alone returns
them. Progress and warnings go to stderr; stdout carries only the result.

It does not batch prompts, stream tokens or apply chat templates.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from goodput.errors import GoodputError
from goodput.eval.inference import is_rank_zero, joined_ranks, load_for_inference
from goodput.train.model import KVCache, Transformer

MAX_NEW_TOKENS = 65_536
STOP_REASONS = ("eod", "max_new_tokens", "max_seq_len", "stop")


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise GoodputError.usage(
                "--temperature",
                f"{self.temperature} is not a finite number >= 0",
                "pass 0 (greedy) or more, e.g. 0.8",
            )
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise GoodputError.usage(
                "--top-p", f"{self.top_p} is not in (0, 1]", "pass a probability mass, e.g. 0.9"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    tokens: list[int]  # the new ids, without the end-of-document token
    stopped: str  # one of STOP_REASONS


class CachedDecoder:
    """A model and its KV cache for one sequence of at most ``capacity`` positions: ``prefill``
    the prompt once, then ``step`` one token at a time; each returns the fp32 logits ``[v]``
    of the next position."""

    def __init__(self, model: Transformer, capacity: int):
        self.model = model
        self.cache: KVCache = model.kv_cache(batch_size=1, capacity=capacity)
        self.device = next(model.parameters()).device

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        assert self.cache.length == 0, "prefill starts an empty cache"
        return self._forward(prompt_ids)

    def step(self, token: int) -> torch.Tensor:
        return self._forward([token])

    def _forward(self, ids: list[int]) -> torch.Tensor:
        tokens_bt = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.model(tokens_bt, cache=self.cache)[0, -1].float()


def choose_token(
    logits_v: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> int:
    """The next id: argmax at temperature 0, else a top-p sample (see the module docstring)."""
    logits_v = logits_v.detach().cpu().double()
    has_nan, top = bool(logits_v.isnan().any()), float(logits_v.max())
    if has_nan or not math.isfinite(top):
        raise GoodputError(
            "the checkpoint's model",
            "gives NaN logits" if has_nan else f"gives no finite largest logit ({top})",
            "its weights are broken: generate from another checkpoint",
        )
    if sampling.temperature == 0:
        return int(logits_v.argmax())
    # Ordered by the logits themselves (weights of nearly equal logits may round equal), and
    # from the largest down: weights in [0, 1], the top one exactly 1, for any T > 0.
    sorted_logits_v, order_v = torch.sort(logits_v, descending=True, stable=True)
    sorted_v = torch.exp((sorted_logits_v - top) / sampling.temperature)
    # Keep each token whose more likely predecessors hold less than top_p of the mass: the
    # first always.
    kept_v = (sorted_v.cumsum(0) - sorted_v) < sampling.top_p * float(sorted_v.sum())
    kept_v[0] = True
    choice = torch.multinomial(sorted_v * kept_v, 1, generator=generator)
    return int(order_v[choice])


def check_prompt(prompt: str) -> None:
    """Refuse a ``--prompt`` that is empty or not UTF-8 (see the module docstring)."""
    if not prompt:
        raise GoodputError.usage("--prompt", "is empty", "pass the text to continue")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        char = ord(prompt[error.start])
        what = (
            f"byte 0x{char - 0xDC00:02x}"
            if 0xDC80 <= char <= 0xDCFF  # a byte the shell's locale could not decode
            else f"the lone surrogate U+{char:04X}"
        )
        raise GoodputError.usage(
            "--prompt",
            f"is not UTF-8 text: {what} at character {error.start}",
            'pass the prompt as UTF-8 (e.g. --prompt "$(iconv -t UTF-8 FILE)")',
        ) from None


@torch.inference_mode()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    eod_id: int | None,
    sampling: Sampling | None = None,
    vocab_size: int | None = None,
    stop: Callable[[list[int]], bool] | None = None,
) -> Generation:
    """Continue ``prompt_ids`` (see the module docstring). ``vocab_size``: ids at or past it
    are never chosen (the tokenizer's vocabulary, when the model's is padded). ``stop``: called
    with the new tokens after each one; true ends generation there."""
    sampling = sampling or Sampling()
    max_seq_len = model.cfg.max_seq_len
    if not prompt_ids:
        raise GoodputError.usage("--prompt", "encodes to no tokens", "pass a non-empty prompt")
    if len(prompt_ids) > max_seq_len:
        raise GoodputError.usage(
            "--prompt",
            f"is {len(prompt_ids)} tokens, more than the model's max_seq_len {max_seq_len}",
            "shorten the prompt",
        )
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise GoodputError.usage(
            "--max-new-tokens", f"{max_new_tokens} is not in [1, {MAX_NEW_TOKENS}]", "pass fewer"
        )
    was_training = model.training
    model.eval()
    try:
        return _decode(model, prompt_ids, max_new_tokens, eod_id, sampling, vocab_size, stop)
    finally:
        model.train(was_training)


def _decode(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    eod_id: int | None,
    sampling: Sampling,
    vocab_size: int | None,
    stop: Callable[[list[int]], bool] | None,
) -> Generation:
    room = model.cfg.max_seq_len - len(prompt_ids)  # new tokens the context has space for
    if room == 0:
        return Generation(tokens=[], stopped="max_seq_len")
    # The last new token is never fed back, so the cache needs one position less than that.
    decoder = CachedDecoder(model, len(prompt_ids) + min(max_new_tokens, room) - 1)
    generator = torch.Generator().manual_seed(sampling.seed)
    new: list[int] = []
    logits_v = decoder.prefill(prompt_ids)
    while True:
        if vocab_size is not None and vocab_size < logits_v.shape[0]:
            logits_v[vocab_size:] = -math.inf
        token = choose_token(logits_v, sampling, generator)
        if token == eod_id:
            return Generation(tokens=new, stopped="eod")
        new.append(token)
        if len(new) == max_new_tokens:
            return Generation(tokens=new, stopped="max_new_tokens")
        if len(new) == room:
            return Generation(tokens=new, stopped="max_seq_len")
        if stop is not None and stop(new):
            return Generation(tokens=new, stopped="stop")
        logits_v = decoder.step(token)


def generate_from_checkpoint(
    path: Path,
    prompt: str,
    *,
    max_new_tokens: int,
    sampling: Sampling,
    tokenizer_path: Path | None = None,
) -> dict[str, Any] | None:
    """``goodput generate``: ``{"prompt", "completion", "tokens", "num_new_tokens",
    "stopped"}`` of a checkpoint or run directory (see the module docstring); None on the ranks
    of a launch other than 0."""
    check_prompt(prompt)
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise GoodputError.usage(
            "--max-new-tokens", f"{max_new_tokens} is not in [1, {MAX_NEW_TOKENS}]", "pass fewer"
        )
    # Warnings of the checks go to stderr: stdout is the result.
    with contextlib.redirect_stdout(sys.stderr), joined_ranks() as runtime:
        loaded = load_for_inference(path, tokenizer_path, runtime)
        if is_rank_zero():
            print(f"generating from {loaded.directory}", flush=True)  # once loaded: one-line errors
        tokenizer = loaded.tokenizer
        result = generate(
            loaded.model,
            tokenizer.encode_batch([prompt])[0],
            max_new_tokens=max_new_tokens,
            eod_id=tokenizer.eod_id,
            sampling=sampling,
            vocab_size=tokenizer.vocab_size,
        )
        if not is_rank_zero():
            return None
    return {
        "prompt": prompt,
        "completion": tokenizer.decode(result.tokens),
        "tokens": result.tokens,
        "num_new_tokens": len(result.tokens),
        "stopped": result.stopped,
    }
