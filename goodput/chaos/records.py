"""What a chaos campaign reads back from its runs, besides ``attempts.jsonl`` (``launch.history``):
the step records of ``metrics.jsonl``, the fired records of ``goodput.chaos.faults``, and the
trainer's ``resume: ... loaded in X s`` lines in the launch log.

All three are outside input, read strictly and bounded: a metrics line is at most
``MAX_LINE_BYTES`` and must be a JSON object whose ``step``, ``loss`` (null when not finite),
``step_time_s`` and ``time`` have the trainer's types (its other keys are the trainer's business
and pass); a fired record is exactly the five keys the fault hooks write, in a file named by its
id; a log line is only matched, never evaluated, and a longer one is cut at ``MAX_LINE_BYTES``.
Whatever breaks these rules is one ``GoodputError`` naming the file (and line). A missing file
reads as empty: a run killed early may not have written it yet.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput.chaos.faults import KINDS, MAX_FAULTS, MAX_ID, MAX_RANK, MAX_STEP
from goodput.errors import GoodputError, from_exception
from goodput.io import read_json

MAX_LINE_BYTES = 1 << 20  # the launcher's longest line; a metrics record is ~300 bytes
MAX_LINES = 100_000_000  # far past any run's steps; a bound on a file that never ends
FIRED_RECORD_BYTES = 4096
FIRED_NAME = re.compile(r"(0|[1-9][0-9]{0,9})\.json")
FIRED_KEYS = frozenset({"id", "kind", "step", "rank", "time"})
RESUME_LINE = re.compile(
    rb"^(?:\[[^\]\n]{0,64}\] )?resume: from .{1,4096} \(step (?P<step>[0-9]{1,15})\) "
    rb"loaded in (?P<seconds>[0-9]{1,9}(?:\.[0-9]{1,9})?) s"
)
METRICS_FIX = (
    "it is not a goodput metrics.jsonl (damaged, or another version's); rerun the campaign"
)
FIRED_FIX = "only goodput's fault hooks write there; rerun the campaign in a new folder"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One line of ``metrics.jsonl``: the step, its loss, how long it took and when it ended."""

    step: int
    loss: float | None  # None: not finite (the trainer writes null)
    step_time_s: float
    time: float  # time.time() when it was recorded


@dataclass(frozen=True, slots=True)
class FiredRecord:
    """A fault that fired: its id and kind, the step it fired at, its rank and time.time()."""

    id: int
    kind: str
    step: int
    rank: int
    time: float


@dataclass(frozen=True, slots=True)
class ResumeLoad:
    step: int  # the checkpoint's step
    seconds: float


def read_step_records(path: Path) -> list[StepRecord]:
    """Every line of ``metrics.jsonl`` in order (a step run again appears again)."""
    return [_step_record(line, f"{path}:{number}") for number, line in _lines(path, METRICS_FIX)]


def _step_record(line: bytes, where: str) -> StepRecord:
    try:
        raw = json.loads(line)
    except (ValueError, RecursionError):
        raise GoodputError(where, "is not a JSON line", METRICS_FIX) from None
    if not isinstance(raw, dict):
        raise GoodputError(where, "is not a JSON object", METRICS_FIX)
    step = raw.get("step")
    if type(step) is not int or not 1 <= step <= MAX_STEP:
        raise GoodputError(where, "has no step number", METRICS_FIX)
    if "loss" not in raw or type(raw["loss"]) not in (int, float, type(None)):
        raise GoodputError(where, "has no loss (a number, or null when not finite)", METRICS_FIX)
    loss = None if raw["loss"] is None else float(raw["loss"])
    step_time_s, when = _seconds(raw, "step_time_s", where), _seconds(raw, "time", where)
    return StepRecord(step, loss, step_time_s, when)


def _seconds(raw: dict[str, Any], key: str, where: str) -> float:
    value: Any = raw.get(key)
    if type(value) not in (int, float) or not (math.isfinite(value) and value >= 0):
        raise GoodputError(where, f"has no {key} (a finite count of seconds)", METRICS_FIX)
    return float(value)


def read_fired(directory: Path) -> list[FiredRecord]:
    """The fired records of ``directory`` (a plan's ``fired_dir``), by id. Temp files of an
    atomic write (dot names) are not records yet and are passed over."""
    try:
        names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    except OSError as exc:
        raise from_exception(exc) from None
    names = [name for name in names if not name.startswith(".")]
    if len(names) > MAX_FAULTS:
        raise GoodputError(directory, f"holds {len(names)} files, more than any plan", FIRED_FIX)
    records = [_fired_record(directory / name) for name in names]
    return sorted(records, key=lambda record: record.id)


def _fired_record(path: Path) -> FiredRecord:
    if not FIRED_NAME.fullmatch(path.name):
        raise GoodputError(path, "is not a fired record (named <id>.json)", FIRED_FIX)
    raw = read_json(path, FIRED_RECORD_BYTES)
    if not isinstance(raw, dict) or set(raw) != FIRED_KEYS:
        raise GoodputError(path, f"is not an object of exactly {sorted(FIRED_KEYS)}", FIRED_FIX)
    checks = (
        ("id", 0, MAX_ID),
        ("step", 1, MAX_STEP),
        ("rank", 0, MAX_RANK),
    )
    for key, low, high in checks:
        value = raw[key]
        if type(value) is not int or not low <= value <= high:
            raise GoodputError(path, f"{key} is not an integer in [{low}, {high}]", FIRED_FIX)
    if raw["kind"] not in KINDS or f"{raw['id']}.json" != path.name:
        raise GoodputError(path, "names an unknown kind, or another fault's id", FIRED_FIX)
    when = raw["time"]
    if type(when) not in (int, float) or not (math.isfinite(when) and when >= 0):
        raise GoodputError(path, "time is not a finite time.time()", FIRED_FIX)
    return FiredRecord(raw["id"], raw["kind"], raw["step"], raw["rank"], float(when))


def read_resume_loads(log: Path) -> list[ResumeLoad]:
    """Each ``resume: from DIR (step N) loaded in X s`` line of a launch log, in order."""
    loads = []
    for _number, line in _lines(log, "it is not a launch log; rerun the campaign"):
        match = RESUME_LINE.match(line)
        if match:
            loads.append(ResumeLoad(int(match["step"]), float(match["seconds"])))
    return loads


def _lines(path: Path, fix: str) -> Iterator[tuple[int, bytes]]:
    """(number, line without its newline) of ``path``, each at most ``MAX_LINE_BYTES`` (a longer
    one comes in pieces); an absent file has none."""
    try:
        stream = open(path, "rb")  # noqa: SIM115 (closed by the with below; absent: no lines)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise from_exception(exc) from None
    with stream:
        for number in range(1, MAX_LINES + 1):
            line = stream.readline(MAX_LINE_BYTES)
            if not line:
                return
            yield number, line.rstrip(b"\n")
    raise GoodputError(path, f"has more than {MAX_LINES:,} lines", fix)
