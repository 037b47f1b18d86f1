"""Fuzz ``io.json_text``, the one writer of every ``--json`` and every run file.

Property: any nested value (objects, lists, text, integers, floats including NaN and the
infinities) gives strict JSON that reads back to the same value with ``NaN``/``Infinity``
refused, or, when it holds a non-finite number, a one-line ``GoodputError`` naming the writer's
``where`` and the key path of such a number; never another exception, never ``NaN`` written.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.io import json_text
from goodput.testing.fuzz import json_values, strict_json


@given(
    json_values(math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324),
    st.sampled_from([None, 2]),
    st.booleans(),
)
def test_any_value_is_strict_json_or_names_its_key(value, indent, sort_keys):
    bad = _non_finite_paths(value, "")
    try:
        text = json_text(value, where="WHERE", indent=indent, sort_keys=sort_keys)
    except GoodputError as error:
        assert bad, value
        assert error.where == "WHERE" and "\n" not in error.render()
        assert any(error.what.startswith(f"would write the non-finite number at {p},") for p in bad)
        return
    assert not bad, text
    assert strict_json(text) == value


def _non_finite_paths(value: Any, path: str) -> list[str]:
    """Every key path (``a.0.b``) of a non-finite number in ``value``, as the writer names it."""
    if isinstance(value, float) and not math.isfinite(value):
        return [path or "the top level"]
    items: Any = ()
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    return [
        found
        for key, item in items
        for found in _non_finite_paths(item, f"{path}.{key}" if path else str(key))
    ]


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ({"optimal_interval_steps": math.inf}, "optimal_interval_steps"),
        ({"curve": [{"loss": 1.0}, {"loss": math.nan}]}, "curve.1.loss"),
        (-math.inf, "the top level"),
    ],
)
def test_the_error_names_the_key(value, key):
    with pytest.raises(GoodputError) as error:
        json_text(value, where="goodput plan reliability --json")
    rendered = error.value.render()
    assert rendered.startswith("goodput plan reliability --json: would write the non-finite")
    assert f" at {key}," in rendered
