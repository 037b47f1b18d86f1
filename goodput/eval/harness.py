"""Scoring multiple-choice items by the log-likelihood a model gives each choice.

Owns ``score_choices`` (a model, a tokenizer and ``ChoiceItem``s -> ``ChoiceScores``) and
``summarize`` (the metrics from per-choice log-likelihoods); and, below them, the request level
that ``lm_eval_model`` shares so both score alike: ``build_request`` (context and continuation
ids -> a ``Request``), ``check_vocabulary`` and ``score_requests`` (requests -> ``Score``s).

Requests. Each (item, choice) pair is one request: ``encode(context) + encode(choice)``, encoded
apart so the continuation's tokens are exactly the choice's (a context that encodes to nothing
becomes the end-of-document token, so the first continuation token has something to follow).
Its score is the continuation's summed log-probability: the logits at position t predict token
t + 1, so the model reads ``ids[:-1]`` and the last ``len(continuation)`` positions are scored,
by the training step's ``token_loss_sum`` (fp32). The model reads at most ``max_len`` tokens: a
longer request loses context tokens from the left and keeps its whole continuation (a
continuation longer than ``max_len`` is refused). Requests run longest first (a batch pads
little), right-padded; attention is causal, so padding never reaches a scored position, and only
scored positions are read, so the pad positions count nowhere. A request is also ``greedy`` when
every continuation token is the argmax of the logits before it (lm-eval's ``is_greedy``).

Metrics (as lm-eval computes them, so numbers compare): ``acc``, the share of items whose
highest summed log-likelihood is the answer; ``acc_norm``, the same after dividing each
log-likelihood by ``normalization_length`` of its choice (its characters, without the one-space
delimiter before it: lm-eval divides by ``len`` of the choice text); ties go to the first choice.
Each comes with its standard error, the sample standard deviation of the 0/1 outcomes over
sqrt(n), i.e. sqrt(p(1 - p) / (n - 1)) (NaN for one item). ``chance`` is the mean of
1 / num_choices.

Distributed. When a process group of W > 1 ranks is initialized, rank r scores items r, r + W,
... and every rank returns the same full ``ChoiceScores`` in item order (``all_gather_object``
of lists of floats, between our own ranks). Every rank runs the same number of forward calls
(padding with a one-token call), so a sharded model, which gathers its parameters inside
forward, cannot hang. The model must be the same on every rank.

Invariants: the log-likelihoods do not depend on ``batch_size`` or the world size (up to the
rounding of the model's own matmuls); scoring runs under ``torch.no_grad`` in eval mode, and the
model's mode is restored after.

It does not read task files (``choice_tasks``), build few-shot prompts or generate text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from goodput.data.tokenizer import Tokenizer
from goodput.errors import GoodputError
from goodput.eval.choice_tasks import ChoiceItem
from goodput.train.loss import token_loss_sum


@dataclass(frozen=True, slots=True, kw_only=True)
class ChoiceScores:
    """What scoring a task gives: per-item log-likelihoods (one per choice, in item order) and
    the metrics (see the module docstring)."""

    loglikelihoods: list[list[float]]
    answers: list[int]
    acc: float
    acc_stderr: float
    acc_norm: float
    acc_norm_stderr: float
    chance: float

    @property
    def num_items(self) -> int:
        return len(self.answers)

    def metrics(self) -> dict[str, float]:
        """The metrics as one flat dict, e.g. for a metrics line."""
        return {
            "acc": self.acc,
            "acc_stderr": self.acc_stderr,
            "acc_norm": self.acc_norm,
            "acc_norm_stderr": self.acc_norm_stderr,
            "chance": self.chance,
            "num_items": self.num_items,
        }


@dataclass(frozen=True, slots=True)
class Request:
    """What the model reads and scores: ``ids[:-1]`` in, the last ``num_continuation`` ids
    scored."""

    ids: list[int]  # context (maybe cut from the left) + continuation
    num_continuation: int


@dataclass(frozen=True, slots=True)
class Score:
    loglikelihood: float  # the continuation's summed log-probability (fp32)
    greedy: bool  # every continuation token is the argmax of the logits before it


def score_choices(
    model: nn.Module,
    tokenizer: Tokenizer,
    items: Sequence[ChoiceItem],
    *,
    batch_size: int = 16,
    device: torch.device | str,
    max_len: int,
) -> ChoiceScores:
    """Score every choice of every item with ``model`` (already on ``device``; ``model(ids_bt)``
    gives logits ``[b, t, v]``); see the module docstring."""
    _check(items, batch_size, max_len)
    rank, world_size = rank_and_world_size()
    mine = range(rank, len(items), world_size)
    vocab_size = getattr(getattr(model, "cfg", None), "vocab_size", None)
    requests = choice_requests(tokenizer, items, mine, max_len, vocab_size)
    num_batches = max(
        math.ceil(sum(len(items[i].choices) for i in range(r, len(items), world_size)) / batch_size)
        for r in range(world_size)
    )
    scores = score_requests(
        model,
        requests,
        batch_size=batch_size,
        device=device,
        pad_id=tokenizer.eod_id,
        num_batches=num_batches,
    )
    flat = [score.loglikelihood for score in scores]
    local, offset = [], 0
    for index in mine:
        num_choices = len(items[index].choices)
        local.append(flat[offset : offset + num_choices])
        offset += num_choices
    return summarize(items, _gathered(local, world_size, len(items)))


def summarize(items: Sequence[ChoiceItem], loglikelihoods: list[list[float]]) -> ChoiceScores:
    """The metrics of ``items`` given each choice's summed log-likelihood."""
    assert len(items) == len(loglikelihoods) > 0
    correct, correct_norm = [], []
    for item, scores in zip(items, loglikelihoods, strict=True):
        assert len(scores) == len(item.choices)
        normalized = [
            score / normalization_length(choice)
            for score, choice in zip(scores, item.choices, strict=True)
        ]
        correct.append(float(_first_argmax(scores) == item.answer))
        correct_norm.append(float(_first_argmax(normalized) == item.answer))
    acc, acc_stderr = _mean_and_stderr(correct)
    acc_norm, acc_norm_stderr = _mean_and_stderr(correct_norm)
    return ChoiceScores(
        loglikelihoods=[list(scores) for scores in loglikelihoods],
        answers=[item.answer for item in items],
        acc=acc,
        acc_stderr=acc_stderr,
        acc_norm=acc_norm,
        acc_norm_stderr=acc_norm_stderr,
        chance=sum(1 / len(item.choices) for item in items) / len(items),
    )


def normalization_length(continuation: str) -> int:
    """What ``acc_norm`` divides a continuation's log-likelihood by: the characters of the
    choice without the one-space delimiter the task put before it (lm-eval's ``len(choice)``);
    at least 1."""
    return max(1, len(continuation.removeprefix(" ")))


def _check(items: Sequence[ChoiceItem], batch_size: int, max_len: int) -> None:
    if not items:
        raise ValueError("no items to score")
    if batch_size < 1 or max_len < 1:
        raise ValueError(f"batch_size ({batch_size}) and max_len ({max_len}) must be positive")
    for index, item in enumerate(items):
        if not item.choices or not 0 <= item.answer < len(item.choices):
            raise ValueError(
                f"item {index}: answer {item.answer} is not one of its {len(item.choices)} choices"
            )


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the world size of the default process group; (0, 1) without."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def choice_requests(
    tokenizer: Tokenizer,
    items: Sequence[ChoiceItem],
    indices: range,
    max_len: int,
    vocab_size: int | None,
) -> list[Request]:
    """The requests of the items at ``indices``, item by item, choice by choice."""
    if not indices:
        return []
    contexts = tokenizer.encode_batch([items[i].context for i in indices])
    choices = tokenizer.encode_batch([c for i in indices for c in items[i].choices])
    check_vocabulary(tokenizer, contexts + choices, vocab_size)
    continuations = iter(choices)
    requests = []
    for index, context_ids in zip(indices, contexts, strict=True):
        for choice_index in range(len(items[index].choices)):
            where = f"item {index}, choice {choice_index}"
            requests.append(
                build_request(
                    context_ids,
                    next(continuations),
                    eod_id=tokenizer.eod_id,
                    max_len=max_len,
                    where=where,
                )
            )
    return requests


def check_vocabulary(
    tokenizer: Tokenizer, id_lists: Sequence[Sequence[int]], vocab_size: int | None
) -> None:
    """Refuse ids the model has no embedding for (a tokenizer other than the model's)."""
    highest = max((max(ids) for ids in id_lists if ids), default=0)
    if vocab_size is not None and highest >= vocab_size:
        raise GoodputError(
            f"tokenizer {tokenizer.path}",
            f"gives token id {highest}, outside the model's vocabulary of {vocab_size}",
            "score with the tokenizer the model was trained with",
        )


def build_request(
    context_ids: Sequence[int],
    continuation_ids: Sequence[int],
    *,
    eod_id: int,
    max_len: int,
    where: str,
) -> Request:
    """One request of context and continuation ids encoded apart (see the module docstring):
    an empty context becomes ``eod_id``; cut from the left to ``max_len + 1`` ids."""
    if not continuation_ids:
        raise GoodputError(where, "encodes to no tokens", "give every choice some text")
    if len(continuation_ids) > max_len:
        raise GoodputError(
            where,
            f"is {len(continuation_ids)} tokens, more than max_len {max_len}",
            "raise max_len or leave the item out",
        )
    ids = (list(context_ids) or [eod_id]) + list(continuation_ids)
    return Request(ids[-(max_len + 1) :], len(continuation_ids))


def score_requests(
    model: nn.Module,
    requests: Sequence[Request],
    *,
    batch_size: int,
    device: torch.device | str,
    pad_id: int,
    num_batches: int | None = None,
    on_batch: Callable[[int], object] | None = None,
) -> list[Score]:
    """Each request's ``Score``, in request order, in eval mode without autograd (the model's
    mode comes back). ``num_batches`` (at least the batches the requests need): make exactly
    that many forward calls, as ``score_choices`` does to keep ranks in step. ``on_batch``:
    called with the number of requests each batch scored (``goodput eval``'s progress)."""
    needed = math.ceil(len(requests) / batch_size)
    assert num_batches is None or num_batches >= needed
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _scores(
                model,
                requests,
                batch_size,
                num_batches or needed,
                torch.device(device),
                pad_id,
                on_batch,
            )
    finally:
        model.train(was_training)


def _scores(
    model: nn.Module,
    requests: Sequence[Request],
    batch_size: int,
    num_batches: int,
    device: torch.device,
    pad_id: int,
    on_batch: Callable[[int], object] | None,
) -> list[Score]:
    """Each request's score, in request order, in ``num_batches`` forward calls."""
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].ids))
    results = [Score(0.0, False)] * len(requests)
    for start in range(0, num_batches * batch_size, batch_size):
        batch = order[start : start + batch_size]
        if not batch:  # this rank is done; its peers may still gather parameters in forward
            model(torch.full((1, 1), pad_id, dtype=torch.long, device=device))
            continue
        width = len(requests[batch[0]].ids) - 1
        inputs_bt = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for row, index in enumerate(batch):
            ids = requests[index].ids
            inputs_bt[row, : len(ids) - 1] = torch.tensor(ids[:-1])
        logits_btv = model(inputs_bt.to(device))
        sums, greedy = [], []
        for row, index in enumerate(batch):
            ids, count = requests[index].ids, requests[index].num_continuation
            # Positions len - count - 1 .. len - 2 predict the continuation's tokens.
            scored_tv = logits_btv[row, len(ids) - count - 1 : len(ids) - 1]
            targets_t = torch.tensor(ids[-count:], device=device)
            sums.append(-token_loss_sum(scored_tv[None], targets_t[None]))
            greedy.append((scored_tv.argmax(-1) == targets_t).all())
        # One transfer per batch, not one per request.
        values, flags = torch.stack(sums).tolist(), torch.stack(greedy).tolist()
        for index, value, flag in zip(batch, values, flags, strict=True):
            results[index] = Score(value, flag)
        if on_batch is not None:
            on_batch(len(batch))
    return results


def _gathered(local: list[list[float]], world_size: int, num_items: int) -> list[list[float]]:
    """Every rank's items back in item order: item i was scored by rank i mod W, as its
    (i div W)-th."""
    if world_size == 1:
        return local
    parts: list[list[list[float]] | None] = [None] * world_size
    dist.all_gather_object(parts, local)
    gathered = []
    for index in range(num_items):
        part = parts[index % world_size]
        assert part is not None
        gathered.append(part[index // world_size])
    return gathered


def _first_argmax(values: Sequence[float]) -> int:
    best = 0
    for index in range(1, len(values)):
        if values[index] > values[best]:
            best = index
    return best


def _mean_and_stderr(outcomes: list[float]) -> tuple[float, float]:
    n = len(outcomes)
    mean = sum(outcomes) / n
    stderr = math.sqrt(mean * (1 - mean) / (n - 1)) if n > 1 else math.nan
    return mean, stderr
