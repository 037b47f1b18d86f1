"""A goodput model as an lm-eval ``LM``: EleutherAI lm-eval's own evaluator, task files and
metrics, run on a goodput checkpoint and scored exactly as goodput's harness scores.

Owns ``GoodputLM`` (a ``Transformer`` and its ``Tokenizer``; ``from_checkpoint`` loads both as
``goodput generate`` does) and its three request types:

* ``loglikelihood`` ``(context, continuation)``: ``harness.build_request`` of the two encoded
  apart (not lm-eval's encode-together-then-split, see docs/evals.md), an empty context becoming
  the end-of-document token, cut from the left to ``max_len``; scored by
  ``harness.score_requests`` (batched, longest first, right-padded, fp32): the summed
  log-probability and whether greedy decoding would have produced the continuation.
* ``loglikelihood_rolling`` ``(text,)``: the text's tokens after the end-of-document token, cut
  into windows by lm-eval's ``get_rolling_token_windows`` (``max_len`` predictions each, every
  token predicted once, the last window reading a full ``max_len`` of context) and
  ``make_disjoint_window``; the sum over the windows. An empty text scores 0.
* ``generate_until`` ``(context, gen_kwargs)``: ``generate.generate`` with the KV cache, greedy
  unless ``do_sample`` (then ``temperature`` and ``top_p``); the prompt keeps its last
  ``max_len - max_gen_toks`` tokens (at least one); generation stops at the end-of-document
  token, ``max_gen_toks``, the model's ``max_seq_len``, or once the decoded new text holds an
  ``until`` string; the text returned ends before the first ``until`` string.

Distributed. Under ``goodput launch`` the model is sharded over the ranks
(``goodput.eval.inference``): a forward is a collective, so every rank runs every request, in
the same order, and lm-eval sees one process on each (its ``rank`` 0 of ``world_size`` 1: it
splits and gathers nothing); rank 0 alone reports.

Invariants: the scores do not depend on ``batch_size`` (up to the model's matmul rounding) or on
the layout; a token id outside the model's vocabulary, a continuation that encodes to
nothing or is longer than ``max_len`` is a ``GoodputError`` naming the task and document.

Progress. Each request type is shown, by rank 0, on stderr as it is scored
(``goodput.progress``: a bar on a terminal, periodic lines otherwise); lm-eval's own bars (its
contexts being built) are lm-eval's.

It does not apply chat templates, batch generation, or read task files (``lm_eval_tasks``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from goodput.data.tokenizer import Tokenizer
from goodput.errors import GoodputError
from goodput.eval.generate import MAX_NEW_TOKENS, Sampling, generate
from goodput.eval.harness import Request, Score, build_request, check_vocabulary, score_requests
from goodput.eval.inference import is_rank_zero, load_for_inference
from goodput.progress import Progress
from goodput.train.model import Transformer
from goodput.train.setup import Runtime

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default for a task that names none


class GoodputLM(LM):
    """lm-eval's ``LM`` over a goodput ``Transformer`` (see the module docstring)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        batch_size: int = 16,
        max_len: int | None = None,
        checkpoint: Path | None = None,
    ):
        super().__init__()
        max_len = model.cfg.max_seq_len if max_len is None else max_len
        if batch_size < 1 or not 1 <= max_len <= model.cfg.max_seq_len:
            raise ValueError(
                f"batch_size ({batch_size}) must be positive and max_len ({max_len}) in "
                f"[1, {model.cfg.max_seq_len}]"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_len = max_len
        self.checkpoint = checkpoint
        self._device = next(model.parameters()).device

    @classmethod
    def from_checkpoint(
        cls,
        path: Path,
        runtime: Runtime | None,
        *,
        tokenizer_path: Path | None = None,
        batch_size: int = 16,
    ) -> GoodputLM:
        """The model of a checkpoint or run directory and its tokenizer, found and loaded as
        ``goodput generate`` finds them (``inference.load_for_inference``: whole in one
        process, sharded over ``runtime``'s ranks)."""
        loaded = load_for_inference(path, tokenizer_path, runtime)
        return cls(
            loaded.model, loaded.tokenizer, batch_size=batch_size, checkpoint=loaded.directory
        )

    # --- requests ------------------------------------------------------------------------

    def loglikelihood(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        pairs = [request.args for request in requests]
        encoded = self._encode(text for pair in pairs for text in pair)
        built = [
            build_request(
                encoded[context],
                encoded[continuation],
                eod_id=self.tokenizer.eod_id,
                max_len=self.max_len,
                where=_where(request),
            )
            for request, (context, continuation) in zip(requests, pairs, strict=True)
        ]
        scores = self._score(built, "loglikelihood", "requests", disable_tqdm)
        results = [(score.loglikelihood, score.greedy) for score in scores]
        for pair, result in zip(pairs, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        texts = [request.args[0] for request in requests]
        encoded = self._encode(texts)
        windows, owners = [], []
        for index, text in enumerate(texts):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=encoded[text],
                    prefix_token=self.tokenizer.eod_id,
                    max_seq_len=self.max_len,
                    context_len=1,
                ),
            ):
                windows.append(Request(context + continuation, len(continuation)))
                owners.append(index)
        totals = [0.0] * len(texts)
        scores = self._score(windows, "loglikelihood_rolling", "windows", disable_tqdm)
        for owner, score in zip(owners, scores, strict=True):
            totals[owner] += score.loglikelihood
        for text, total in zip(texts, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        results = []
        with self._progress("generate_until", len(requests), "requests", disable_tqdm) as done:
            for request in requests:
                context, gen_kwargs = request.args
                text = self._generate(context, gen_kwargs, _where(request))
                self.cache_hook.add_partial("generate_until", request.args, text)
                results.append(text)
                done.advance(1)
        return results

    # --- helpers ---------------------------------------------------------------------------

    def _encode(self, texts: Iterable[str]) -> dict[str, list[int]]:
        """Each distinct text's ids (a multiple-choice context is encoded once, not per
        choice), checked against the model's vocabulary."""
        unique = list(dict.fromkeys(texts))
        ids = self.tokenizer.encode_batch(unique)
        check_vocabulary(self.tokenizer, ids, self.model.cfg.vocab_size)
        return dict(zip(unique, ids, strict=True))

    def _progress(self, kind: str, total: int, unit: str, disable: bool) -> Progress:
        """One request type's progress, shown by rank 0 only (every rank runs the same), on
        stderr."""
        show = is_rank_zero() and not disable
        return Progress(f"goodput eval: {kind}", total=total, unit=unit, show=show)

    def _score(self, requests: list[Request], kind: str, unit: str, disable: bool) -> list[Score]:
        with self._progress(kind, len(requests), unit, disable) as done:
            return score_requests(
                self.model,
                requests,
                batch_size=self.batch_size,
                device=self.device,
                pad_id=self.tokenizer.eod_id,
                on_batch=done.advance,
            )

    def _generate(self, context: str, gen_kwargs: dict[str, Any], where: str) -> str:
        until, max_new_tokens, sampling = generation_settings(gen_kwargs, where)
        prompt_ids = self._encode([context])[context] or [self.tokenizer.eod_id]
        # Leave room for the new tokens, as lm-eval's own models do; keep at least one token.
        prompt_ids = prompt_ids[-max(1, self.max_len - max_new_tokens) :]

        def reached_until(new: list[int]) -> bool:
            text = self.tokenizer.decode(new)
            return any(stop in text for stop in until)

        result = generate(
            self.model,
            prompt_ids,
            max_new_tokens=max_new_tokens,
            eod_id=self.tokenizer.eod_id,
            sampling=sampling,
            vocab_size=self.tokenizer.vocab_size,
            stop=reached_until if until else None,
        )
        return cut_at_first(self.tokenizer.decode(result.tokens), until)


def generation_settings(gen_kwargs: Any, where: str) -> tuple[list[str], int, Sampling]:
    """A task's ``generation_kwargs`` (lm-eval's, normalized) as the stop strings, the new
    tokens at most and the sampling; a value that is not one is a usage error naming the task
    (``where``), not the command line's options."""
    try:
        kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
        until = [text for text in kwargs["until"] if text]
        if not all(isinstance(text, str) for text in until):
            raise TypeError(f"until holds a non-string: {until!r}")
        max_new_tokens = min(max(int(kwargs["max_gen_toks"]), 1), MAX_NEW_TOKENS)
        sampling = Sampling()
        if kwargs["do_sample"]:
            top_p = float(kwargs.get("top_p") or 1.0)
            sampling = Sampling(temperature=float(kwargs["temperature"]), top_p=top_p)
    except GoodputError as error:
        raise GoodputError.usage(
            f"{where}: generation_kwargs",
            f"{error.where.lstrip('-').replace('-', '_')} {error.what}",
            "fix the task file's generation_kwargs",
        ) from None
    except (TypeError, ValueError, KeyError, OverflowError) as error:
        raise GoodputError.usage(
            f"{where}: generation_kwargs",
            f"are not lm-eval's generation settings ({type(error).__name__}: {error})",
            "fix the task file's generation_kwargs: until (strings), max_gen_toks (a count), "
            "do_sample, temperature (>= 0), top_p (in (0, 1])",
        ) from None
    return until, max_new_tokens, sampling


def cut_at_first(text: str, stops: list[str]) -> str:
    """``text`` up to (without) the earliest of ``stops`` that it holds."""
    end = min((index for stop in stops if (index := text.find(stop)) >= 0), default=len(text))
    return text[:end]


def _where(request: Instance) -> str:
    return f"lm-eval task {request.task_name}, document {request.doc_id}, request {request.idx}"
