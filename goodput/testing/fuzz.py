"""What the fuzz tests (``tests/fuzz``) share: JSON-shaped values, and the one property every
parser of outside input keeps — a result, or a one-line ``GoodputError``, never anything else."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from goodput.errors import MAX_RENDERED_CHARS, GoodputError


def json_values(*leaves: Any) -> st.SearchStrategy[Any]:
    """Any JSON value (small), with ``leaves`` mixed in among the scalars."""
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    if leaves:
        scalars |= st.sampled_from(leaves)
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=10), children, max_size=4)
        ),
        max_leaves=20,
    )


def strict_json(text: str) -> Any:
    """``text`` parsed as strict JSON: Python's reader takes ``NaN`` and ``Infinity``, which
    JSON does not have, so each is a failed assertion here."""

    def refuse(constant: str) -> Any:
        raise AssertionError(f"not strict JSON: {constant} in {text[:200]!r}")

    return json.loads(text, parse_constant=refuse)


def result_or_refusal(read: Callable[..., Any], *args: Any) -> Any | None:
    """``read(*args)``, or None when it refused with a one-line ``GoodputError``; any other
    exception propagates and fails the test."""
    try:
        return read(*args)
    except GoodputError as error:
        line = error.render()
        assert "\n" not in line and len(line) <= MAX_RENDERED_CHARS
        return None
