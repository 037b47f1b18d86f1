"""TOML -> frozen typed dataclasses, with dotted command-line overrides.

One loader for every component config. A config class is a
``@dataclass(frozen=True, slots=True, kw_only=True)`` whose fields are scalars, lists or nested
config classes (a TOML table each). Unknown keys are rejected with the valid ones listed; values
are checked against the field's type; ``section.key=value`` overrides are parsed as TOML values
(so ``lr=3e-4`` is a float and ``name=foo`` a string).

Every number is checked here, at parse time, naming its key: it must be finite and in
``[0, 2**53]`` unless its field's ``limits(...)`` metadata says otherwise (``dim: int =
field(metadata=limits(at_least=1, at_most=2**17))``; ``inf_ok`` for a field where inf means "no
limit"). A text field never holds a NUL byte, and one marked ``NON_EMPTY`` is never blank. That
is the one way a config states a range; cross-field checks belong in each class's
``__post_init__``, raising ``GoodputError``. A missing required key is named with the override
that adds it (``[data] file_list is not set; add data.file_list=PATH ...``: ``example(...)``
metadata says what its value is). Two keys of which exactly one is set (``data.file_list`` or
``data.stages``) say so in ``one_of(...)`` metadata: neither and both are refused, naming both. A
list of config classes is an array of tables (``[[data.stages]]``; ``tuple[StageConfig, ...]``),
its entries named by index (``data.stages[1].start_step``); an override reaches into one
by its index (``data.stages.1.start_step=50``), and an override of one key of a ``one_of`` group
replaces the file's other (the command line wins). A key that cannot take effect under its table's
other values is refused, naming what would enable it (``refuse_inert_keys``). ``to_toml`` writes a
built config back out (the run directory's resolved config), an array of tables as inline
tables; ``None`` fields are left out, so they must default to ``None``.

A renamed key is listed in its class's ``RENAMED`` (old name -> new name, in the same table) and
read for one more release under its new name, with one warning line (``read_renamed``): both
spellings set differently in one file are refused; an override of either spelling replaces the
file's value under the other (the command line wins). A value's old spelling (``true`` for
``"full"``) is listed in its class's ``RENAMED_VALUES`` and read the same way
(``read_renamed_values``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from goodput.errors import GoodputError, warn_deprecated
from goodput.io import read_text

T = TypeVar("T")

MAX_NUMBER = 2**53  # far above any config number; beyond it a float no longer holds every integer


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """The numbers a field admits: ``low`` to ``high``, each end included unless ``*_open``."""

    low: float = 0
    high: float = MAX_NUMBER
    low_open: bool = False
    high_open: bool = False
    inf_ok: bool = False  # +inf is admitted too: the field reads it as "no limit"
    why: str = ""  # what breaks beyond the range, for the error's fix

    def admits(self, value: float) -> bool:
        if value == math.inf and self.inf_ok:
            return True
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below  # NaN is neither

    def __str__(self) -> str:
        opening, closing = "(" if self.low_open else "[", ")" if self.high_open else "]"
        interval = f"{opening}{_show(self.low)}, {_show(self.high)}{closing}"
        return f"{interval} or inf" if self.inf_ok else interval


def _show(bound: float) -> str:
    if bound == MAX_NUMBER:
        return "2**53"
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


DEFAULT_LIMITS = Limits()
NON_EMPTY: Mapping[str, bool] = types.MappingProxyType({"non_empty": True})


def limits(
    *,
    at_least: float = 0,
    above: float | None = None,
    at_most: float = MAX_NUMBER,
    below: float | None = None,
    inf_ok: bool = False,
    why: str = "",
) -> dict[str, Limits]:
    """Field metadata: the range the loader admits for this number (or each number of a list);
    ``above``/``below`` exclude their end, ``at_least``/``at_most`` include it. The range is the
    one the code works in, in reasonable time: whatever a rank would refuse or choke on later is
    outside it. ``why`` says what goes wrong beyond it (the error's fix quotes it)."""
    low, low_open = (at_least, False) if above is None else (above, True)
    high, high_open = (at_most, False) if below is None else (below, True)
    return {"limits": Limits(low, high, low_open, high_open, inf_ok, why)}


def load_config(cls: type[T], path: str | Path | None, overrides: Sequence[str] = ()) -> T:
    """Read ``path`` (TOML; None for defaults), apply ``a.b=value`` overrides, build ``cls``."""
    raw = read_toml(path) if path is not None else {}
    for item in overrides:
        apply_override(raw, _command_line_wins(cls, raw, item))
    return from_table(cls, raw, str(path) if path is not None else "<defaults>")


def _command_line_wins(cls: type, raw: dict[str, Any], item: str) -> str:
    """Override ``item`` with a renamed key spelled by its new name (and the warning line); the
    file's value under the other spelling is dropped from ``raw``, so the override wins. So is
    the file's value of the other keys of its ``one_of`` group (``data.stages=[...]`` on the
    command line replaces the file's ``data.file_list``)."""
    key, sep, value = item.partition("=")
    *parents, leaf = key.strip().split(".")
    table: Any = raw
    for part in parents:
        if isinstance(table, list):  # an array of tables: cls is its entries' class
            table = table[int(part)] if part.isdigit() and int(part) < len(table) else None
            continue
        hint = type_hints(cls).get(part) if dataclasses.is_dataclass(cls) else None
        hint = _entry_class(hint) or hint
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            return item  # not a config table: apply_override or from_table names the error
        cls, table = hint, table.get(part) if isinstance(table, dict) else None
    if sep and isinstance(table, dict) and dataclasses.is_dataclass(cls):
        for field in dataclasses.fields(cls):
            if field.name == leaf:  # the file's other key of the group gives way
                for other in field.metadata.get("one_of", ()):
                    table.pop(other, None)
    renamed: Mapping[str, str] = getattr(cls, "RENAMED", {})
    if not sep or not renamed:
        return item
    prefix = "".join(f"{part}." for part in parents)
    if leaf in renamed:
        warn_deprecated(f"{prefix}{leaf}", f"{prefix}{renamed[leaf]}")
        leaf = renamed[leaf]
    if isinstance(table, dict):
        for old, new in renamed.items():
            if new == leaf:
                table.pop(old, None)
    return f"{prefix}{leaf}={value}"


def _entry_class(hint: Any) -> type | None:
    """The config class of an array of tables (``tuple[StageConfig, ...] | None``), else None."""
    for option in typing.get_args(hint) or (hint,):
        entries = typing.get_args(option)
        if typing.get_origin(option) is tuple and entries and dataclasses.is_dataclass(entries[0]):
            return entries[0]  # type: ignore[return-value]
    return None


def read_renamed(cls: type, table: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """``table`` with each deprecated key of ``cls`` (its ``RENAMED``) under its new name, with
    one warning line; the two spellings set differently are refused."""
    renamed: Mapping[str, str] = getattr(cls, "RENAMED", {})
    for old, new in renamed.items():
        if old not in table:
            continue
        if new in table and table[new] != table[old]:
            raise GoodputError.usage(
                where,
                f"{prefix}{new} and {prefix}{old} are both set, differently",
                f"set {prefix}{new} only ({prefix}{old} is deprecated)",
            )
        warn_deprecated(f"{prefix}{old}", f"{prefix}{new}")
        table = {**{k: v for k, v in table.items() if k != old}, new: table[old]}
    return table


def read_renamed_values(
    cls: type, table: dict[str, Any], where: str, prefix: str = ""
) -> dict[str, Any]:
    """``table`` with each deprecated spelling of a value (its class's ``RENAMED_VALUES``: key ->
    old value -> new value) as the new one, with one warning line. Matched by type as well, so
    that ``true`` is never taken for ``1``."""
    renamed: Mapping[str, Mapping[object, str]] = getattr(cls, "RENAMED_VALUES", {})
    for key, values in renamed.items():
        old = table.get(key)
        for spelling, value in values.items():
            if type(old) is type(spelling) and old == spelling:
                warn_deprecated(
                    f"{prefix}{key} = {json.dumps(old)}", f"{prefix}{key} = {json.dumps(value)}"
                )
                table = {**table, key: value}
    return table


def load_section(cls: type[T], path: str | Path, section: str, overrides: Sequence[str] = ()) -> T:
    """Build ``cls`` from one ``[section]`` of a TOML file (a component gets only its own
    part); overrides are ``key=value`` within the section."""
    raw = read_toml(path)
    if not isinstance(raw.get(section), dict):
        raise GoodputError.usage(path, f"no [{section}] table", f"add a [{section}] section")
    for item in overrides:
        apply_override(raw[section], item)
    return from_table(cls, raw[section], str(path), f"{section}.")


def to_toml(config: Any) -> str:
    """A built config as TOML that ``from_table`` reads back to an equal config."""
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
    if isinstance(value, dict):  # an entry of an array of tables: an inline table
        items = (f"{key} = {_toml_value(item)}" for key, item in value.items() if item is not None)
        return "{" + ", ".join(items) + "}"
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
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise GoodputError.usage(path, "TOML nested too deeply", "fix the syntax") from None


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
        parsed = tomllib.loads(f"v = {text}")
    except (tomllib.TOMLDecodeError, RecursionError):
        parsed = {}
    # A bare word is a string; so is text that parses only with more TOML after it ("1\nx=2").
    value = parsed["v"] if parsed.keys() == {"v"} else text
    node: Any = raw
    *parents, leaf = key.strip().split(".")
    for part in parents:
        node = _child(node, part, key)
        if not isinstance(node, dict | list):
            raise GoodputError.usage(
                key,
                f"'{part}' is a value, not a section",
                "override a key inside a section",
            )
    if isinstance(node, list):
        raise GoodputError.usage(
            key,
            f"'{parents[-1]}' is a list of tables",
            f"override a key of one: {'.'.join(parents)}.0.KEY=...",
        )
    node[leaf] = value


def _child(node: dict[str, Any] | list[Any], part: str, key: str) -> Any:
    """The table ``part`` of ``node`` (made when absent), or of a list (an array of tables),
    its entry at index ``part``."""
    if isinstance(node, dict):
        return node.setdefault(part, {})
    if not (part.isdigit() and int(part) < len(node)):
        raise GoodputError.usage(
            key, f"'{part}' is not an index of a list of {len(node)}", "use 0, 1, ... of the list"
        )
    return node[int(part)]


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints`` of a config class, once: it compiles every annotation anew,
    which was two thirds of reading the launcher's 10,624 forensics reports. Read-only."""
    return typing.get_type_hints(cls)


def from_table(cls: type[T], raw: dict[str, Any], where: str, prefix: str = "") -> T:
    """Build config ``cls`` from a nested dict, rejecting unknown keys and wrong types."""
    raw = read_renamed_values(cls, read_renamed(cls, raw, where, prefix), where, prefix)
    hints = type_hints(typing.cast(type, cls))  # mypy does not see type[T] as hashable
    fields = _known_fields(cls, raw, where, prefix)
    raw = _refuse_missing(fields, hints, raw, where, prefix)
    _refuse_both(fields, raw, where, prefix)
    kwargs = _coerce_table(hints, fields, raw, where, prefix)
    try:
        config = cls(**kwargs)
    except GoodputError as exc:
        if not exc.where.startswith("["):
            raise
        # A cross-field check names its section; add the file it came from.
        raise GoodputError(f"{where} {exc.where}", exc.what, exc.fix, code=exc.code) from None
    refuse_inert_keys(config, raw, where, prefix)
    return config


def read_present(cls: type, raw: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """The keys of ``raw`` (one table of config ``cls``) that are there, each read as
    ``from_table`` reads it (a renamed key under its new name, its type and range checked); an
    unknown key is refused, a missing one is simply absent. For a reader that takes what a file
    says and fills in the rest its own way (``goodput plan``): no class is built, so no
    required key is asked for and no cross-field check runs."""
    raw = read_renamed(cls, raw, where, prefix)
    fields = _known_fields(cls, raw, where, prefix)
    return _coerce_table(type_hints(cls), fields, raw, where, prefix)


def _known_fields(
    cls: type, raw: Mapping[str, Any], where: str, prefix: str
) -> dict[str, dataclasses.Field[Any]]:
    """The fields of ``cls`` a table sets, by name; a key of ``raw`` that is none of them is
    refused, naming the valid ones."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise GoodputError.usage(
            where,
            f"unknown key '{prefix}{unknown[0]}'",
            f"valid keys{' in [' + prefix.rstrip('.') + ']' if prefix else ''}: "
            + ", ".join(sorted(fields)),
        )
    return fields


def _coerce_table(
    hints: Mapping[str, Any],
    fields: Mapping[str, dataclasses.Field[Any]],
    raw: Mapping[str, Any],
    where: str,
    prefix: str,
) -> dict[str, Any]:
    """Each value of ``raw`` checked and converted as its field says (``_coerce``)."""
    return {
        name: _coerce(hints[name], value, where, f"{prefix}{name}", fields[name].metadata)
        for name, value in raw.items()
    }


def _refuse_missing(
    fields: Mapping[str, dataclasses.Field[Any]],
    hints: Mapping[str, Any],
    raw: dict[str, Any],
    where: str,
    prefix: str,
) -> dict[str, Any]:
    """``raw`` with each required table it lacks as an empty one, which is then refused for its
    own first required key (``[data] file_list is not set``, not that ``[data]`` is); a missing
    required value is refused here, naming the override that adds it (the field's
    ``example(...)`` metadata says what its value is)."""
    for name, field in fields.items():
        others = field.metadata.get("one_of", ())
        if name in raw or not (_required(field) or others) or any(other in raw for other in others):
            continue
        if dataclasses.is_dataclass(hints[name]):
            raw = {**raw, name: {}}
            continue
        key = f"[{prefix.rstrip('.')}] {name}" if prefix else f"'{name}'"
        dotted = re.sub(r"\[(\d+)\]", r".\1", prefix)  # an override names a list's table by index
        fix = " or ".join(
            f"add {dotted}{each}={fields[each].metadata.get('example', 'VALUE')}"
            for each in (name, *others)
        )
        raise GoodputError.usage(where, f"{key} is not set", fix)
    return raw


def _refuse_both(
    fields: Mapping[str, dataclasses.Field[Any]], raw: dict[str, Any], where: str, prefix: str
) -> None:
    """Refuse two keys of one ``one_of`` group set together."""
    for name, field in fields.items():
        both = [other for other in field.metadata.get("one_of", ()) if other in raw]
        if name in raw and both:
            raise GoodputError.usage(
                where,
                f"'{prefix}{name}' and '{prefix}{both[0]}' are both set",
                "set one of them, not both",
            )


def one_of(*others: str) -> dict[str, tuple[str, ...]]:
    """Field metadata: exactly one of this key and ``others`` (keys of the same table, each
    with this metadata naming the rest) is set; the field defaults to ``None``."""
    return {"one_of": others}


def _required(field: dataclasses.Field[Any]) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def example(value: str) -> dict[str, str]:
    """Field metadata: what the key's value is, for the error that names it missing
    (``add data.file_list=PATH (...)``)."""
    return {"example": value}


def refuse_inert_keys(config: Any, raw: Mapping[str, Any], where: str, prefix: str = "") -> None:
    """Refuse a key of ``raw`` (the table as written) that cannot take effect in ``config``.

    A config class states its rules in one method, ``inert_keys() -> {field: what enables
    it}``, listing the fields that do nothing under its other values (a pipeline key without a
    pipeline, a Muon key with another optimizer). A key written at its default value is let
    through: a resolved ``config.toml`` spells out every key, and the default is what runs."""
    rules = getattr(config, "inert_keys", None)
    if rules is None:
        return
    defaults = {f.name: f for f in dataclasses.fields(config)}
    for name, enabled_by in rules().items():
        if name in raw and getattr(config, name) != _default(defaults[name]):
            section = prefix.rstrip(".")
            raise GoodputError.usage(
                where,
                f"'{prefix}{name}' is set but has no effect: it needs {enabled_by}"
                + (f" in [{section}]" if section else ""),
                f"set {enabled_by}, or drop {prefix}{name}",
            )


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def coerce_field(cls: type, name: str, value: Any, where: str, key: str) -> Any:
    """``value`` checked as field ``name`` of config ``cls`` would be, with ``key`` named in the
    error: for readers of other formats (an HF ``config.json``) that fill a config class."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return _coerce(type_hints(cls)[name], value, where, key, field.metadata)


def _coerce(hint: Any, value: Any, where: str, key: str, metadata: Mapping[str, Any]) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise _type_error(where, key, "a table", value)
        return from_table(hint, value, where, f"{key}.")  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is not type(None):
                try:
                    return _coerce(option, value, where, key, metadata)
                except GoodputError as error:
                    errors.append(error)
        if len(errors) == 1:  # X | None: X's own error says more ("out of range", a nested key)
            raise errors[0]
        raise _type_error(where, key, " or ".join(_name(o) for o in options), value)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise _type_error(where, key, "a list", value)
        args = typing.get_args(hint) or (Any,)
        if origin is tuple and args[-1] is not Ellipsis:  # tuple[float, float]: exactly two
            if len(value) != len(args):
                raise _type_error(where, key, f"a list of {len(args)}", value)
            item_hints = args
        else:
            item_hints = (args[0],) * len(value)
        items = [
            _coerce(item_hint, v, where, f"{key}[{i}]", metadata)
            for i, (item_hint, v) in enumerate(zip(item_hints, value, strict=True))
        ]
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
    if hint in (int, float):
        return _number(hint, value, where, key, metadata.get("limits", DEFAULT_LIMITS))
    if hint is str:
        return _text(value, where, key, metadata.get("non_empty", False))
    if hint is bool and not isinstance(value, bool):
        raise _type_error(where, key, "true or false", value)
    if isinstance(hint, type) and not isinstance(value, hint):
        raise _type_error(where, key, _name(hint), value)
    return value


def _number(hint: type, value: Any, where: str, key: str, bounds: Limits) -> int | float:
    # bool is an int to Python, never to a config; an int is a float, a float never an int.
    if isinstance(value, bool) or not isinstance(value, int if hint is int else int | float):
        raise _type_error(where, key, _name(hint), value)
    number = hint(value)
    if not bounds.admits(number):
        raise GoodputError.usage(
            where,
            f"'{key}' = {value!r} is not in {bounds}",
            f"use a value in that range{f' ({bounds.why})' if bounds.why else ''}",
        )
    return number


def _text(value: Any, where: str, key: str, non_empty: bool) -> str:
    if not isinstance(value, str):
        raise _type_error(where, key, "str", value)
    if "\0" in value:  # no path or name holds one; the OS would refuse it later, less clearly
        raise _type_error(where, key, "text without NUL bytes", value)
    if non_empty and not value.strip():
        raise GoodputError.usage(where, f"'{key}' is empty", "give it a value")
    return value


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def _type_error(where: str, key: str, expected: str, value: Any) -> GoodputError:
    return GoodputError.usage(
        where,
        f"'{key}' must be {expected}, got {value!r}",
        "fix the value in the config or the override",
    )
