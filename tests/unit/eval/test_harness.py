"""Multiple-choice scoring: a bigram table pins the log-likelihoods and metrics by hand; a tiny
goodput Transformer shows batching, truncation and two gloo ranks change nothing."""

import math
import random
import statistics

import pytest
import torch

from goodput.data.tokenizer import Tokenizer
from goodput.errors import GoodputError
from goodput.eval.choice_tasks import ChoiceItem
from goodput.eval.harness import normalization_length, score_choices, summarize
from goodput.testing.bigram import BigramModel, CharTokenizer
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL
from goodput.train.model import Transformer

HAND_ITEMS = [
    ChoiceItem("a", (" b", " ab"), 1),
    ChoiceItem("b", (" a", " b", " bb"), 1),
    ChoiceItem("ab", (" b", " a"), 1),
    ChoiceItem("", (" a", " b"), 0),  # no context tokens: the end of document stands in
]
L = math.log
HAND_LOGLIKELIHOODS = [
    # P(" " | a) P(b | " "), and P(" " | a) P(a | " ") P(b | a)
    [L(0.2 * 0.3), L(0.2 * 0.5 * 0.3)],
    [L(0.3 * 0.5), L(0.3 * 0.3), L(0.3 * 0.3 * 0.4)],
    [L(0.3 * 0.3), L(0.3 * 0.5)],
    [L(0.3 * 0.5), L(0.3 * 0.3)],  # after the end of document
]


@pytest.mark.parametrize("batch_size", [1, 2, 16])
def test_hand_computed_loglikelihoods_and_metrics(batch_size):
    model = BigramModel().train()
    scores = score_choices(
        model, CharTokenizer(" ab"), HAND_ITEMS, batch_size=batch_size, device="cpu", max_len=64
    )
    for got, expected in zip(scores.loglikelihoods, HAND_LOGLIKELIHOODS, strict=True):
        assert got == pytest.approx(expected, abs=1e-6)
    # acc: argmaxes 0, 0, 1, 0 against answers 1, 1, 1, 0. acc_norm divides by the characters
    # without the leading space: item 0 becomes (-2.81, -3.51 / 2 = -1.75) -> 1 (right);
    # item 1 (-1.90, -2.41, -3.32 / 2 = -1.66) -> 2 (wrong); items 2 and 3 keep their argmax.
    acc_outcomes, norm_outcomes = [0, 0, 1, 1], [1, 0, 1, 1]
    assert scores.acc == 0.5 and scores.acc_norm == 0.75
    assert scores.acc_stderr == pytest.approx(math.sqrt(0.5 * 0.5 / 3))
    assert scores.acc_norm_stderr == pytest.approx(math.sqrt(0.75 * 0.25 / 3))
    assert scores.acc_stderr == pytest.approx(statistics.stdev(acc_outcomes) / 2)
    assert scores.acc_norm_stderr == pytest.approx(statistics.stdev(norm_outcomes) / 2)
    assert scores.chance == pytest.approx((1 / 2 + 1 / 3 + 1 / 2 + 1 / 2) / 4)
    assert scores.answers == [1, 1, 1, 0] and scores.num_items == 4
    # Eval mode and no autograd while scoring; the model's mode comes back.
    assert set(model.seen_modes) == {(False, False)} and model.training
    assert model.table.grad is None


# Another batch shape or thread count may round a float32 sum differently: a few units in
# the last place (one is 1.2e-7 of the value), which some CPUs' kernels show and others do not.
FLOAT32_REL = 1e-6


def test_summarize_ties_go_to_the_first_choice_and_one_item_has_no_stderr():
    scores = summarize([ChoiceItem("c", (" xy", " zw"), 1)], [[-2.0, -2.0]])
    assert scores.acc == 0.0 and scores.acc_norm == 0.0
    assert math.isnan(scores.acc_stderr) and scores.metrics()["num_items"] == 1
    assert normalization_length(" xy") == 2 and normalization_length("xy") == 2
    assert normalization_length(" ") == 1  # never a division by zero


ALPHABET = "abcdefghijklmnopqrstuvwxyz .,?!ABCDEFGHIJKLMNOPQRSTUVWXYZ012"  # 60 ids + end


def random_items(num_items: int, seed: int = 0) -> list[ChoiceItem]:
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(low, high)))

    items = []
    for _ in range(num_items):
        choices = tuple(" " + text(1, 9) for _ in range(rng.randint(2, 5)))
        items.append(ChoiceItem(text(1, 30), choices, rng.randrange(len(choices))))
    return items


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(TINY_MODEL)


def one_by_one(model: Transformer, tokenizer: Tokenizer, item: ChoiceItem) -> list[float]:
    """The reference: each request alone, no padding, the log-softmax read position by position."""
    (context,) = tokenizer.encode_batch([item.context])
    sums = []
    for continuation in tokenizer.encode_batch(list(item.choices)):
        ids = torch.tensor([context + continuation])
        with torch.no_grad():
            logprobs = model(ids[:, :-1]).log_softmax(-1)[0]
        start = len(context) - 1  # this position predicts the first continuation token
        sums.append(sum(float(logprobs[start + k, t]) for k, t in enumerate(continuation)))
    return sums


def test_batch_size_and_padding_change_no_loglikelihood():
    model, tokenizer, items = tiny_model(), CharTokenizer(ALPHABET), random_items(11)
    one = score_choices(model, tokenizer, items, batch_size=1, device="cpu", max_len=64)
    seven = score_choices(model, tokenizer, items, batch_size=7, device="cpu", max_len=64)
    for a, b, item in zip(one.loglikelihoods, seven.loglikelihoods, items, strict=True):
        assert a == pytest.approx(b, rel=FLOAT32_REL)
        assert a == pytest.approx(one_by_one(model, tokenizer, item), abs=1e-5)
    assert one.acc == seven.acc and one.acc_norm == seven.acc_norm


def test_a_long_context_is_cut_from_the_left_and_the_continuation_kept():
    model, tokenizer = tiny_model(), CharTokenizer(ALPHABET)
    context, choices = "the quick brown fox jumps over the lazy dog", (" yes", " no way")
    max_len = 12

    def score(item_context: str, length: int) -> list[float]:
        item = ChoiceItem(item_context, choices, 0)
        scores = score_choices(model, tokenizer, [item], device="cpu", max_len=length)
        return scores.loglikelihoods[0]

    cut = score(context, max_len)
    # The model reads max_len tokens: context + continuation keep max_len + 1 of them.
    kept = [
        score(context[-(max_len + 1 - len(choice)) :], 64)[i] for i, choice in enumerate(choices)
    ]
    assert cut == pytest.approx(kept, rel=FLOAT32_REL)
    assert cut != pytest.approx(score(context, 64), abs=1e-3)
    with pytest.raises(GoodputError, match="item 0, choice 1: is 7 tokens, more than max_len 6"):
        score(context, 6)


def test_ids_outside_the_models_vocabulary_are_refused():
    item = ChoiceItem("abc", (" a", " b"), 0)
    wide = CharTokenizer(ALPHABET + "é")  # the old ids stay; "é" is id 61, past the model's
    far_item = ChoiceItem("abc", (" a", " é"), 0)
    score_choices(tiny_model(), wide, [item], device="cpu", max_len=16)
    with pytest.raises(GoodputError, match="outside the model's vocabulary of 61"):
        score_choices(tiny_model(), wide, [far_item], device="cpu", max_len=16)


def test_bad_arguments_are_value_errors():
    model, tokenizer = BigramModel(), CharTokenizer(" ab")
    with pytest.raises(ValueError, match="no items"):
        score_choices(model, tokenizer, [], device="cpu", max_len=8)
    with pytest.raises(ValueError, match="must be positive"):
        score_choices(model, tokenizer, HAND_ITEMS, batch_size=0, device="cpu", max_len=8)
    with pytest.raises(ValueError, match="item 0: answer 2"):
        score_choices(model, tokenizer, [ChoiceItem("a", (" a", " b"), 2)], device="cpu", max_len=8)


NUM_DIST_ITEMS = 7  # odd: the ranks score different numbers of items


def score_on_rank(rank, world_size):
    model, forwards = tiny_model(), []
    model.register_forward_hook(lambda *_: forwards.append(1))
    items = random_items(NUM_DIST_ITEMS, seed=1)
    scores = score_choices(
        model, CharTokenizer(ALPHABET), items, batch_size=3, device="cpu", max_len=64
    )
    return scores, len(forwards)


def test_two_gloo_ranks_give_the_one_process_result():
    reference, _ = score_on_rank(0, 1)
    results = run_distributed(score_on_rank, 2)
    # Every rank makes the same number of forward calls (a sharded model would hang otherwise).
    assert results[0][1] == results[1][1]
    for scores, _ in results:
        assert scores.answers == reference.answers
        for a, b in zip(scores.loglikelihoods, reference.loglikelihoods, strict=True):
            assert a == pytest.approx(b, rel=FLOAT32_REL)
        assert (scores.acc, scores.acc_norm) == (reference.acc, reference.acc_norm)
        assert scores.acc_stderr == pytest.approx(reference.acc_stderr)
