"""What a chaos campaign reads back from its runs, besides ``attempts.jsonl`` (``launch.history``):
the step records of ``metrics.jsonl``, the fired records of ``goodput.faults``, and the
trainer's ``resume: ... loaded in X s`` lines in the launch log.

All three are outside input, read strictly and bounded, from regular files only (a FIFO is
refused, never waited on): a metrics line is read as every reader of a run's metrics reads it
(``io.read_json_lines``, at most ``rundir.MAX_LINE_BYTES``) and must be a JSON object whose
``step``, ``loss`` (null when not finite), ``step_time_s`` and ``time`` have the trainer's types
(its other keys are the trainer's business and pass); a fired record is exactly the five keys
the fault hooks write, in a file named by its id (what is no regular file in that folder is
skipped, with a note); a log line is only matched, never evaluated, and one longer than
``MAX_LOG_LINE_BYTES`` is passed over. Whatever breaks these rules is one ``GoodputError``
naming the file (and line). A missing file reads as empty: a run killed early may not have
written it yet.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput import rundir
from goodput.errors import GoodputError, from_exception
from goodput.faults import KINDS, MAX_FAULTS, MAX_ID, MAX_RANK, MAX_STEP
from goodput.io import read_json, read_json_lines, read_lines, regular_files

# The launcher cuts a rank's line at 1 MiB and puts a host label before it; what is longer is
# no line of its, and no resume line either.
MAX_LOG_LINE_BYTES = 2 << 20
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
    """Every whole line of ``metrics.jsonl`` in order (a step run again appears again)."""
    if not os.path.lexists(path):
        return []
    lines = read_json_lines(path, rundir.MAX_LINE_BYTES, fix=METRICS_FIX)
    return [_step_record(raw, where) for where, raw in lines]


def _step_record(raw: dict[str, Any], where: str) -> StepRecord:
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
        paths = list(directory.iterdir()) if directory.is_dir() else []
    except OSError as exc:
        raise from_exception(exc) from None
    paths = regular_files(path for path in paths if not path.name.startswith("."))
    if len(paths) > MAX_FAULTS:
        raise GoodputError(directory, f"holds {len(paths)} files, more than any plan", FIRED_FIX)
    records = [_fired_record(path) for path in paths]
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
    if not os.path.lexists(log):
        return []
    fix = "it is not a launch log; rerun the campaign"
    loads = []
    for _number, line in read_lines(log, MAX_LOG_LINE_BYTES, fix=fix, skip_long=True):
        match = RESUME_LINE.match(line)
        if match:
            loads.append(ResumeLoad(int(match["step"]), float(match["seconds"])))
    return loads
