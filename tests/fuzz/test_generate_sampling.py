"""Fuzz ``goodput generate``'s sampler over its documented ranges: every temperature that is a
finite number >= 0 (down to the smallest subnormal, up to the largest float) and every top-p in
(0, 1], on any logits a model can give (any finite floats, ids masked to -inf past the
tokenizer's vocabulary): a valid token id, never an exception; NaN or +inf logits are one
error naming the model. Options outside the ranges are usage errors naming the option."""

import math
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import ExitCode, GoodputError
from goodput.eval.generate import Sampling, check_prompt, choose_token

temperatures = st.sampled_from([0.0, 5e-324, 1e-300, 1e-30, 1e-7, 1.0, 1e30, sys.float_info.max])
temperatures |= st.floats(min_value=0, allow_nan=False, allow_infinity=False)
top_ps = st.sampled_from([5e-324, 1e-300, 1e-6, 0.5, 1.0]) | st.floats(
    min_value=0, max_value=1, exclude_min=True, allow_nan=False
)
fp32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
logits = st.lists(fp32, min_size=1, max_size=40)


@given(logits, temperatures, top_ps, st.integers(0, 40), st.integers(0, 2**32))
def test_every_documented_setting_samples_a_valid_token(values, temperature, top_p, masked, seed):
    logits_v = torch.tensor(values, dtype=torch.float32)
    keep = max(1, len(values) - masked)
    logits_v[keep:] = -math.inf  # ids past the tokenizer's vocabulary, as generate masks them
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    token = choose_token(logits_v, sampling, generator)
    assert isinstance(token, int) and 0 <= token < keep
    if temperature == 0:
        assert token == int(logits_v.argmax())


@given(logits, temperatures, top_ps)
def test_the_most_likely_token_can_always_be_drawn_and_a_tiny_top_p_is_greedy(
    values, temperature, top_p
):
    logits_v = torch.tensor(values, dtype=torch.float32)
    greedy = Sampling(temperature=max(temperature, 1e-300), top_p=5e-324)
    token = choose_token(logits_v, greedy, torch.Generator().manual_seed(0))
    assert logits_v[token] == logits_v.max()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_broken_logits_are_one_error_naming_the_model(bad):
    logits_v = torch.tensor([0.0, bad, 1.0])
    with pytest.raises(GoodputError) as caught:
        choose_token(logits_v, Sampling(temperature=1.0), torch.Generator())
    assert caught.value.where == "the checkpoint's model"
    all_masked = torch.full((3,), -math.inf)
    with pytest.raises(GoodputError, match="no finite largest logit"):
        choose_token(all_masked, Sampling(), None)


@given(st.floats(), st.floats())
def test_settings_outside_the_ranges_are_usage_errors_naming_the_option(temperature, top_p):
    try:
        Sampling(temperature=temperature, top_p=top_p)
    except GoodputError as error:
        assert error.code == ExitCode.USAGE and error.where in ("--temperature", "--top-p")
        return
    assert math.isfinite(temperature) and temperature >= 0 and 0 < top_p <= 1


@given(st.text(max_size=30))
def test_any_prompt_is_utf8_text_or_one_usage_error_naming_prompt(prompt):
    try:
        check_prompt(prompt)
    except GoodputError as error:
        assert error.where == "--prompt" and error.code == ExitCode.USAGE
        assert prompt == "" or any(0xD800 <= ord(char) <= 0xDFFF for char in prompt)
        return
    prompt.encode("utf-8")


def test_undecodable_bytes_name_the_byte():
    argv_prompt = b"ok \xff".decode("utf-8", "surrogateescape")  # as Python reads argv
    with pytest.raises(GoodputError, match=r"byte 0xff at character 3"):
        check_prompt(argv_prompt)
