"""``stage`` and ``tokens`` of a metrics.jsonl line, as every reader parses them: whole numbers
>= 0; anything else is one error naming the line and the key, and a reader can require both."""

from __future__ import annotations

import pytest

from goodput import runfiles
from goodput.errors import GoodputError


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("stage", -1, "-1"),
        ("stage", 1.0, "1.0"),
        ("stage", True, "true"),
        ("stage", "1", '"1"'),
        ("tokens", None, "null"),
        ("tokens", 1 << 62, str(1 << 62)),
        ("tokens", [4096], "an array"),
    ],
)
def test_a_stage_or_token_count_that_is_not_a_count_is_refused(key, value, shown):
    with pytest.raises(GoodputError) as caught:
        runfiles.parse_step({"step": 1, key: value}, "metrics.jsonl:7")
    assert caught.value.render() == (
        f"metrics.jsonl:7: {key!r} is {shown}, not a whole number >= 0; {runfiles.FIX}"
    )


def test_a_reader_can_require_both():
    line = runfiles.parse_step({"step": 3, "stage": 1, "tokens": 768}, "m:1", require=("tokens",))
    assert (line.raw["stage"], line.number("tokens")) == (1, 768.0)
    with pytest.raises(GoodputError, match="'stage' is missing"):
        runfiles.parse_step({"step": 3}, "m:1", require=("stage", "tokens"))
