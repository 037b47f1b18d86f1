"""Fuzz the run-config loader: TOML text and dotted overrides against ``RunConfig``.

Property: ``load_config`` returns a ``RunConfig`` or raises ``GoodputError``; never another
exception. Inputs are random text, the shipped tiny config with a slice replaced, and
well-formed TOML built from the real keys with hostile values (NaN, ±inf, huge or negative
numbers, wrong types, nesting).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.config import load_config
from goodput.errors import GoodputError
from goodput.train.config.run import RunConfig

TINY = Path(__file__).parents[2] / "configs" / "tiny-cpu.toml"


def dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every key of a config class as a dotted path, nested tables and renamed keys (their
    deprecated spellings) included."""
    keys = [prefix + old for old in getattr(cls, "RENAMED", {})]
    for field in dataclasses.fields(cls):
        keys.append(prefix + field.name)
        hint = typing.get_type_hints(cls)[field.name]
        for option in typing.get_args(hint) or (hint,):
            if dataclasses.is_dataclass(option):
                keys += dotted_keys(option, f"{prefix}{field.name}.")  # type: ignore[arg-type]
    return keys


KEYS = dotted_keys(RunConfig)


def toml_scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # nan, inf and -inf are TOML floats
    return json.dumps(value)  # ints as they are, strings as basic strings


scalars = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**53, 2**53 + 1, 2**63 - 1]),
    st.floats(),
    st.booleans(),
    st.text(max_size=20),
)
values = st.recursive(
    scalars.map(toml_scalar),
    lambda inner: st.lists(inner, max_size=4).map(lambda items: f"[{', '.join(items)}]"),
    max_leaves=8,
)
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=15))
overrides = st.lists(st.tuples(keys, values | st.text(max_size=20)), max_size=5).map(
    lambda pairs: [f"{key}={value}" for key, value in pairs]
)


def loads_or_refuses(path: Path, items: list[str]) -> None:
    try:
        cfg = load_config(RunConfig, path, items)
    except GoodputError as error:
        assert error.render().count("\n") == 0
    else:
        assert isinstance(cfg, RunConfig)


@given(text=st.text(max_size=300), items=overrides)
def test_random_text_and_overrides(tmp_path, text, items):
    path = tmp_path / "run.toml"
    path.write_text(text, errors="surrogatepass")
    loads_or_refuses(path, items)


@given(data=st.data(), items=overrides)
def test_the_tiny_config_with_a_slice_replaced(tmp_path, data, items):
    text = TINY.read_text()
    start = data.draw(st.integers(0, len(text)))
    end = data.draw(st.integers(start, min(len(text), start + 40)))
    replacement = data.draw(st.one_of(values, st.text(max_size=20)))
    path = tmp_path / "run.toml"
    path.write_text(text[:start] + replacement + text[end:], errors="surrogatepass")
    loads_or_refuses(path, items)


@given(items=st.lists(st.tuples(st.sampled_from(KEYS), values), min_size=1, max_size=8))
def test_real_keys_with_hostile_values(items):
    loads_or_refuses(TINY, [f"{key}={value}" for key, value in items])
