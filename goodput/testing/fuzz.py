"""What the fuzz tests (``tests/fuzz``) share: JSON-shaped values, and the one property every
parser of outside input keeps — a result, or a one-line ``GoodputError``, never anything else."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from goodput.errors import GoodputError


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


def result_or_refusal(read: Callable[..., Any], *args: Any) -> Any | None:
    """``read(*args)``, or None when it refused with a one-line ``GoodputError``; any other
    exception propagates and fails the test."""
    try:
        return read(*args)
    except GoodputError as error:
        assert "\n" not in error.render()
        return None
