"""``goodput eval --samples``: lm-eval's per-document records as strict JSON lines, whatever
numbers and objects they hold (a log-likelihood of -inf, a NaN metric, a tuple, a type JSON has
no name for)."""

from __future__ import annotations

import math

from goodput.commands.eval import _sample_lines
from goodput.testing.fuzz import strict_json


class Opaque:
    def __str__(self) -> str:
        return "opaque"


def test_non_finite_numbers_are_null_and_other_objects_their_text():
    record = {
        "doc_id": 3,
        "target": "yes",
        "arguments": (("ctx", " yes"),),
        "filtered_resps": [(-math.inf, False), (-1.5, True)],
        "filter": "none",
        "metrics": ["acc", "perplexity"],
        "acc": math.nan,
        "perplexity": Opaque(),
    }
    (line,) = _sample_lines({"tiny": [record]})
    assert line.endswith("\n")
    assert strict_json(line) == {
        "task": "tiny",
        "doc_id": 3,
        "target": "yes",
        "arguments": [["ctx", " yes"]],
        "filtered_resps": [[None, False], [-1.5, True]],
        "filter": "none",
        "metrics": {"acc": None, "perplexity": "opaque"},
    }
