"""TOML -> frozen typed dataclasses, with dotted command-line overrides.

One loader for every component config. A config class is a
``@dataclass(frozen=True, slots=True, kw_only=True)`` whose fields are scalars, lists or nested
config classes (a TOML table each). Unknown keys are rejected with the valid ones listed; values
are checked against the field's type; ``section.key=value`` overrides are parsed as TOML values
(so ``lr=3e-4`` is a float and ``name=foo`` a string). Cross-field checks belong in each class's
``__post_init__``, raising ``GoodputError``. ``to_toml`` writes a built config back out (the
run directory's resolved config); ``None`` fields are left out, so they must default to ``None``.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from goodput.errors import GoodputError
from goodput.io import read_text

T = TypeVar("T")


def load_config(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """Read ``path`` (TOML; None for defaults), apply ``a.b=value`` overrides, build ``cls``."""
    raw = read_toml(path) if path is not None else {}
    for item in overrides:
        apply_override(raw, item)
    return build(cls, raw, str(path) if path is not None else "<defaults>")


def load_section(cls: type[T], path: str | Path, section: str, overrides: Sequence[str] = ()) -> T:
    """Build ``cls`` from one ``[section]`` of a TOML file (a component gets only its own
    part); overrides are ``key=value`` within the section."""
    raw = read_toml(path)
    if not isinstance(raw.get(section), dict):
        raise GoodputError.usage(path, f"no [{section}] table", f"add a [{section}] section")
    for item in overrides:
        apply_override(raw[section], item)
    return build(cls, raw[section], str(path), f"{section}.")


def to_toml(config: Any) -> str:
    """A built config as TOML that ``build`` reads back to an equal config."""
    return _toml_table(dataclasses.asdict(config), "")


def _toml_table(table: dict[str, Any], name: str) -> str:
    values = {k: v for k, v in table.items() if v is not None and not isinstance(v, dict)}
    tables = {k: v for k, v in table.items() if isinstance(v, dict)}
    lines = [f"[{name}]"] if name and values else []
    lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    text = "\n".join(lines) + "\n" if lines else ""
    for key, sub in tables.items():
        text += ("\n" if text else "") + _toml_table(sub, f"{name}.{key}" if name else key)
    return text


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # inf and nan are valid TOML floats; repr round-trips exactly
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def read_toml(path: str | Path) -> dict[str, Any]:
    try:
        return tomllib.loads(read_text(path))
    except GoodputError as exc:  # unreadable, too big, not UTF-8: a config problem
        raise GoodputError.usage(exc.where, exc.what, exc.fix) from None
    except tomllib.TOMLDecodeError as exc:
        raise GoodputError.usage(path, f"invalid TOML: {exc}", "fix the syntax") from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict, parsing ``value`` as a TOML value when it is one."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise GoodputError.usage(
            item,
            "override is not of the form section.key=value",
            "write e.g. data.seed=7",
        )
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word: take it as a string
    node = raw
    *parents, leaf = key.strip().split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise GoodputError.usage(
                key,
                f"'{part}' is a value, not a section",
                "override a key inside a section",
            )
    node[leaf] = value


def build(cls: type[T], raw: dict[str, Any], where: str, prefix: str = "") -> T:
    """Build config ``cls`` from a nested dict, rejecting unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise GoodputError.usage(
            where,
            f"unknown key '{prefix}{unknown[0]}'",
            f"valid keys{' in [' + prefix.rstrip('.') + ']' if prefix else ''}: "
            + ", ".join(sorted(fields)),
        )
    kwargs = {
        name: _coerce(hints[name], value, where, f"{prefix}{name}") for name, value in raw.items()
    }
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise GoodputError.usage(
            where,
            f"[{prefix.rstrip('.') or 'top level'}] {exc}",
            "add the missing key",
        ) from None
    except GoodputError as exc:
        if not exc.where.startswith("["):
            raise
        # A cross-field check names its section; add the file it came from.
        raise GoodputError(f"{where} {exc.where}", exc.what, exc.fix, code=exc.code) from None


def _coerce(hint: Any, value: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise _type_error(where, key, "a table", value)
        return build(hint, value, where, f"{key}.")  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is not type(None):
                try:
                    return _coerce(option, value, where, key)
                except GoodputError:
                    continue
        raise _type_error(where, key, " or ".join(_name(o) for o in options), value)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise _type_error(where, key, "a list", value)
        (item_hint, *_rest) = typing.get_args(hint) or (Any,)
        items = [_coerce(item_hint, v, where, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise GoodputError.usage(
                where,
                f"'{key}' = {value!r} is not allowed",
                f"use one of {', '.join(map(repr, typing.get_args(hint)))}",
            )
        return value
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise _type_error(where, key, "true or false", value)
    if isinstance(hint, type) and not isinstance(value, hint):
        raise _type_error(where, key, _name(hint), value)
    return value


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def _type_error(where: str, key: str, expected: str, value: Any) -> GoodputError:
    return GoodputError.usage(
        where,
        f"'{key}' must be {expected}, got {value!r}",
        "fix the value in the config or the override",
    )
