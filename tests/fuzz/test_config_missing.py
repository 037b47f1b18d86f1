"""Fuzz the loader's refusal of a run config with keys or tables left out.

Property: whatever keys and tables of the CPU demo's config are dropped, ``load_config`` builds
a ``RunConfig`` or raises one usage error (exit 2) in one line; when it says a key "is not set",
that key was dropped (or its whole table was), and the error's fix is the override that adds it.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.config import load_config
from goodput.errors import ExitCode, GoodputError
from goodput.train.config.run import RunConfig

TINY = Path(__file__).parents[2] / "configs" / "tiny-cpu.toml"
TABLE = tomllib.loads(TINY.read_text())
DOTTED = sorted(
    f"{table}.{key}" for table, keys in TABLE.items() for key in keys if table != "model"
) + sorted(TABLE)
NOT_SET = re.compile(r"\[(\w+)\] (\w+) is not set")


@given(dropped=st.sets(st.sampled_from(DOTTED), max_size=6))
def test_dropped_keys_are_named_with_the_override_that_adds_them(tmp_path, dropped):
    raw = {table: dict(keys) for table, keys in TABLE.items()}
    for item in dropped:
        table, _, key = item.partition(".")
        if key:
            raw.get(table, {}).pop(key, None)
        else:
            raw.pop(table)
    path = tmp_path / "run.toml"
    path.write_text(
        "".join(  # the demo's values are scalars: JSON writes each as TOML reads it
            f"[{table}]\n" + "".join(f"{key} = {json.dumps(v)}\n" for key, v in keys.items())
            for table, keys in raw.items()
        )
    )
    try:
        load_config(RunConfig, path)
    except GoodputError as error:
        assert error.code == ExitCode.USAGE and "\n" not in error.render()
        named = NOT_SET.search(error.what)
        if named:
            table, key = named.groups()
            assert f"{table}.{key}" in dropped or table in dropped
            assert error.fix.startswith(f"add {table}.{key}=")
