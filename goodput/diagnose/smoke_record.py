"""The smoke record: the file ``goodput diagnose smoke --record`` writes and ``--baseline`` reads.

One JSON object, written atomically (``goodput.io.write_json``)::

    {
      "format": "goodput-smoke",
      "version": 2,
      "world_size": 2,
      "config": ["[model]", "vocab_size = 4096", ...],
      "environment": {"torch": "2.13.0+cpu", "device": "cpu", "device_name": "AMD EPYC",
                      "cpu_capability": "AVX512", "goodput": "0.1.0", "git_sha": "1a2b...",
                      "python": "3.11.9", "data_fingerprint": "24b3ca23..."},
      "steps": [{"step": 1, "loss": 8.331509590148926, "grad_norm": 1.0945953130722046,
                 "peak_memory_gib": 0.4701042175292969}, ...]
    }

``config`` is the run config as the smoke ran it, as TOML lines, with the paths that only mean
something on the recording machine replaced (lines, so that a refreshed baseline diffs well).
The layout is ``world_size`` (the ranks ``goodput launch`` started) with the config's
``[parallel]`` table. Version 1, written before the smoke ran layouts, has no ``world_size``: it
was one process, and reads as ``world_size`` 1 (the committed demo baseline is one).
Every number is a float64 written as Python's ``repr``: the shortest decimal that reads back to
the same double, so the values in a record are the run's bits. Which values are compared bit for
bit and which within a tolerance is ``smoke.py``'s.

Reading a record is a trust boundary (a baseline comes from a repository or a colleague): the
file is bounded in size, every key is required and no other is allowed, every type is checked,
every number is finite and >= 0, the steps run 1..N with N at most ``MAX_STEPS``, the world size
is a whole number from 1 to ``MAX_RANKS``, environment values are short printable text. Any
failure is one ``GoodputError`` naming the file and the field, with exit code 2 (a bad input, like
a bad option), so that exit 1 from the gate always means "the numbers differ".
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from goodput.errors import GoodputError
from goodput.io import read_json, write_json
from goodput.launch.env import MAX_RANKS
from goodput.outputs import SMOKE_FORMAT

VERSION = 2
VERSION_WITHOUT_LAYOUT = 1  # one process: read as world_size 1
MAX_RECORD_BYTES = 4 << 20  # 10,000 steps take about 1 MB
MAX_STEPS = 10_000  # a smoke run is minutes; beyond this it is a training run
MAX_CONFIG_CHARS = 64 << 10  # all lines together
MAX_CONFIG_LINES = 2_000
MAX_TEXT_CHARS = 256  # one environment value
METRICS = ("loss", "grad_norm", "peak_memory_gib")
# What the environment holds, each with the label a difference is reported under.
ENVIRONMENT_LABELS = {
    "torch": "torch",
    "device": "device",
    "device_name": "device name",
    "cpu_capability": "CPU capability",
    "goodput": "goodput",
    "git_sha": "git",
    "python": "python",
    "data_fingerprint": "data fingerprint",
}
KEYS = ("format", "version", "world_size", "config", "environment", "steps")
KEYS_WITHOUT_LAYOUT = tuple(key for key in KEYS if key != "world_size")
STEP_KEYS = ("step", *METRICS)
FIX = "restore it from version control, or record it again with `goodput diagnose smoke --record`"


@dataclass(frozen=True, slots=True)
class StepValues:
    step: int
    loss: float
    grad_norm: float
    peak_memory_gib: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SmokeRecord:
    config: str  # TOML text, newline-terminated; its [parallel] table is half the layout
    world_size: int  # the ranks it ran on: the other half
    environment: Mapping[str, str]  # ENVIRONMENT_LABELS' keys
    steps: tuple[StepValues, ...]  # steps 1..N


def write_record(path: Path, record: SmokeRecord) -> None:
    """Write ``record`` atomically; its numbers must be finite (the reader refuses others)."""
    assert all(math.isfinite(getattr(s, m)) for s in record.steps for m in METRICS)
    write_json(
        path,
        {
            "format": SMOKE_FORMAT,
            "version": VERSION,
            "world_size": record.world_size,
            "config": record.config.splitlines(),
            "environment": dict(record.environment),
            "steps": [asdict(values) for values in record.steps],
        },
    )


def read_record(path: Path) -> SmokeRecord:
    """The record in ``path``, checked field by field; anything else is a one-line usage error."""
    try:
        raw = read_json(path, MAX_RECORD_BYTES)
    except GoodputError as error:
        raise GoodputError.usage(error.where, error.what, error.fix) from None
    version = raw.get("version") if isinstance(raw, dict) else None
    without_layout = type(version) is int and version == VERSION_WITHOUT_LAYOUT
    top = _object(path, "the file", raw, KEYS_WITHOUT_LAYOUT if without_layout else KEYS)
    if top["format"] != SMOKE_FORMAT:
        raise _refusal(
            path, "format", f"is {_show(top['format'])}, not {SMOKE_FORMAT!r}: not a smoke record"
        )
    if not without_layout and (type(version) is not int or version != VERSION):
        raise GoodputError.usage(
            path,
            f"version {_show(version)} is not a smoke record version this goodput reads "
            f"({VERSION_WITHOUT_LAYOUT} or {VERSION})",
            "record the baseline again with this goodput (`goodput diagnose smoke --record`)",
        )
    return SmokeRecord(
        config=_config(path, top["config"]),
        world_size=1 if without_layout else _world_size(path, top["world_size"]),
        environment=_environment(path, top["environment"]),
        steps=_steps(path, top["steps"]),
    )


def _world_size(path: Path, value: Any) -> int:
    if type(value) is not int or not 1 <= value <= MAX_RANKS:
        raise _refusal(
            path, "world_size", f"is {_show(value)}, not a whole number from 1 to {MAX_RANKS:,}"
        )
    return value


def _config(path: Path, value: Any) -> str:
    if (
        not isinstance(value, list)
        or len(value) > MAX_CONFIG_LINES
        or not all(isinstance(line, str) and "\n" not in line for line in value)
        or sum(len(line) + 1 for line in value) > MAX_CONFIG_CHARS
    ):
        raise _refusal(
            path,
            "config",
            f"is not a list of at most {MAX_CONFIG_LINES:,} TOML lines ({MAX_CONFIG_CHARS:,} "
            "characters)",
        )
    text = "".join(f"{line}\n" for line in value)
    try:
        tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as error:
        raise _refusal(path, "config", f"is not valid TOML ({error})") from None
    return text


def _environment(path: Path, value: Any) -> dict[str, str]:
    environment = _object(path, "environment", value, tuple(ENVIRONMENT_LABELS))
    for key, text in environment.items():
        if not isinstance(text, str) or len(text) > MAX_TEXT_CHARS or not text.isprintable():
            raise _refusal(
                path,
                f"environment.{key}",
                f"is {_show(text)}, not printable text of at most {MAX_TEXT_CHARS} characters",
            )
    return environment


def _steps(path: Path, value: Any) -> tuple[StepValues, ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_STEPS:
        raise _refusal(path, "steps", f"is not a list of 1 to {MAX_STEPS:,} steps")
    steps = []
    for index, item in enumerate(value):
        field = f"steps[{index}]"
        fields = _object(path, field, item, STEP_KEYS)
        if type(fields["step"]) is not int or fields["step"] != index + 1:
            raise _refusal(path, f"{field}.step", f"is {_show(fields['step'])}, not {index + 1}")
        for metric in METRICS:
            number = fields[metric]
            # All three are >= 0 by definition: a cross-entropy, a norm, a size.
            if type(number) is not float or not 0 <= number < math.inf:
                raise _refusal(
                    path, f"{field}.{metric}", f"is {_show(number)}, not a finite number >= 0"
                )
        steps.append(StepValues(**fields))
    return tuple(steps)


def _object(path: Path, field: str, value: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """``value`` as a JSON object with exactly ``keys``."""
    if not isinstance(value, dict):
        raise _refusal(path, field, f"is {_show(value)}, not a JSON object")
    missing = [key for key in keys if key not in value]
    if missing:
        raise _refusal(path, field, f"lacks the key {missing[0]!r}")
    unknown = [key for key in value if key not in keys]
    if unknown:
        raise _refusal(path, field, f"has an unknown key {_show(unknown[0])}")
    return value


def _refusal(path: Path, field: str, what: str) -> GoodputError:
    return GoodputError.usage(path, f"{field} {what}", FIX)


def _show(value: Any, max_chars: int = 40) -> str:
    """A value from the file, quoted short enough for a one-line error."""
    text = repr(value)
    return text if len(text) <= max_chars else f"{text[: max_chars - 3]}..."
