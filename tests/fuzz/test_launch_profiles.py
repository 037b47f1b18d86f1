"""Fuzz machine profiles (``goodput launch --profile FILE.toml``).

Property: ``load_profile`` returns a ``ProfileConfig`` whose values are in range, or raises a
one-line ``GoodputError`` naming the file; never another exception. Inputs are random bytes, a
shipped profile with a slice replaced, and well-formed TOML of the real keys (and unknown ones)
with hostile values: wrong types, NaN and infinities, huge numbers, regular expressions that do
not compile or name no host, names with newlines.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.launch.launchers import MAX_PPN, PROFILE_DIR, ProfileConfig, load_profile

AURORA = (PROFILE_DIR / "aurora.toml").read_bytes()
KEYS = [field.name for field in dataclasses.fields(ProfileConfig) if field.name != "name"]


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # nan, inf and -inf are TOML floats
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    return json.dumps(value)  # ints as they are, strings as basic strings


hostile_text = st.one_of(
    st.text(max_size=20),
    st.sampled_from(
        [
            "(?P<host>[\\w.-]+): Killed", "(?P<addr>[0-9.]+)", "(?P<host>x", "x{4294967296}",
            "(" * 200 + ")" * 200, "no host group", "A=1", "A\n=1", "=1", "cores", "cores\n",
            "list:1-8:9-16", "true", "hydra", "pals", "",
        ]
    ),
)  # fmt: skip
scalars = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    hostile_text,
)
values = st.one_of(scalars, st.lists(scalars, max_size=4))


@st.composite
def profiles(draw) -> bytes:
    keys = st.one_of(st.sampled_from(KEYS), st.sampled_from(["name", "ppm", "srun"]))
    table = draw(st.dictionaries(keys, values, max_size=5))
    return "".join(f"{key} = {toml_value(value)}\n" for key, value in table.items()).encode()


@st.composite
def spliced(draw) -> bytes:
    start = draw(st.integers(0, len(AURORA)))
    end = draw(st.integers(start, min(len(AURORA), start + 40)))
    return AURORA[:start] + draw(st.binary(max_size=20)) + AURORA[end:]


@given(st.one_of(profiles(), spliced(), st.binary(max_size=300)))
def test_a_profile_loads_in_range_or_is_refused_naming_its_file(tmp_path_factory, data):
    path = Path(tmp_path_factory.mktemp("profile")) / "site.toml"
    path.write_bytes(data)
    try:
        profile = load_profile(str(path))
    except GoodputError as error:
        assert "\n" not in error.render() and str(path) in error.render()
        return
    assert profile.name == "site" and 1 <= profile.ppn <= MAX_PPN
    assert math.isfinite(profile.health_timeout_s) and profile.health_timeout_s > 0
    assert profile.health_check and all(isinstance(arg, str) for arg in profile.health_check)
    assert all("=" in item for item in profile.env)
