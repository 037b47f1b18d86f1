"""The fault hooks' fired records, as a chaos campaign reads them back: the one run file of a
campaign that is not a run directory's (the runs themselves are read by ``report.run_files``).

Outside input, read strictly and bounded: a fired record is exactly the five keys the fault
hooks write, in a file named by its id, at most ``FIRED_RECORD_BYTES``; what is no regular file
in the folder is skipped, with a note (a FIFO is refused, never waited on); temp files of an
atomic write (dot names) are not records yet. Whatever breaks these rules is one
``GoodputError`` naming the file. A missing folder reads as empty: a run killed early may not
have written it yet.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from goodput.errors import GoodputError, from_exception
from goodput.faults import KINDS, MAX_FAULTS, MAX_ID, MAX_RANK, MAX_STEP
from goodput.io import read_json, regular_files

FIRED_RECORD_BYTES = 4096
FIRED_NAME = re.compile(r"(0|[1-9][0-9]{0,9})\.json")
FIRED_KEYS = frozenset({"id", "kind", "step", "rank", "time"})
FIRED_FIX = "only goodput's fault hooks write there; rerun the campaign in a new folder"


@dataclass(frozen=True, slots=True)
class FiredRecord:
    """A fault that fired: its id and kind, the step it fired at, its rank and time.time()."""

    id: int
    kind: str
    step: int
    rank: int
    time: float


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
