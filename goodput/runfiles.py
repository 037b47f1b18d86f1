"""The line schema of a run's JSON-lines files: what one line of ``metrics.jsonl`` and of
``evals.jsonl`` holds, built and serialised here for their writers (``train/metrics.py``,
``eval/records.py``) and parsed here for every reader (``report``, ``diagnose smoke`` and
``batch-size``, the demo). ``rundir.py`` names the files; this module says what is in them.
Standard library only. ``attempts.jsonl`` keeps its schema with its one writer and reader,
``launch/history.py``.

``metrics.jsonl``: one object per step, appended by rank 0. ``StepRecord`` is what the trainer
writes of every step, its fields in the line's order, each carrying its kind (``STEP_KEYS``);
what else the step measured (a mixture of experts' load, the diagnostics, the loop's timings,
the in-loop evals) follows in the order measured. A float that is not finite is written as
``null`` (strict JSON). Only ``step`` is required of every line; a reader names the other keys
it cannot do without (``read_steps(require=...)``), so a line that holds fewer keys than the
trainer writes (a synthetic run's, ``testing/run_dirs.py``) reads where it has what is asked.

``run.json``'s ``data.stages`` (``StageMixture``): each data-mix stage's start step, file list
and its corpora's target and achieved shares, read by the report.

``evals.jsonl``: one object per eval metric, ``EvalLine``'s fields in order, every one of an
evaluation's lines in one synced write.

``busy.jsonl``: one object per window of ``[watch] straggler_steps`` steps (``BusyLine``),
appended by rank 0 (``train/monitor/stragglers.py``), of a size independent of the world's: the
window's last step, its length, the ranks judged, the quantiles over ranks of each rank's mean
busy time a step (``QUANTILES``: min and max exact, the others the writer's fixed-size histogram's,
within a bin) and the ``SLOWEST`` slowest ranks, slowest first, each with its host. An older
goodput's line (a row per host) is refused naming ``FILE:LINE`` and how to keep the newer lines.

Reading is strict and bounded (``io.read_json_lines``): a line past ``rundir.MAX_LINE_BYTES``,
past ``MAX_LINES`` lines, not one JSON object, a known key whose value is not of its kind, or a
required key missing is one ``GoodputError`` naming ``FILE:LINE``. A key this module does not
know is passed unchecked (a diagnostic's, a held-out corpus's). A last line without its newline
(its writer died, or is writing it) is left out. Readers check their own bounds beyond a kind's
(``diagnose batch-size``'s usable gns).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, overload

from goodput import rundir
from goodput.config import MAX_NUMBER, read_toml
from goodput.errors import GoodputError
from goodput.io import json_text, read_json_lines

FIX = "it is not what goodput wrote; restore it or move it out of the run directory"
MAX_LINES = 10_000_000  # a run file past this is not one run's
# A step, a count: far past any run's. Counts are JSON integers, read as Python's: exact at any
# size (a float is exact only to 2**53; ``StepLine.numbers`` is for plotting, not counting).
MAX_COUNT = 1 << 62
MAX_NAME_CHARS = 200  # an eval's task, metric and source
KIND = "kind"  # the key of a StepRecord field's kind in its metadata


@dataclass(frozen=True, slots=True)
class Kind:
    """What a key's value must be: ``what`` says it in an error, ``admits`` checks it."""

    what: str
    admits: Callable[[Any], bool]


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)  # not bool, a subclass of int


def _finite(value: Any) -> bool:
    kind = type(value)
    if kind is float:  # the common case first: every line of a run file holds many
        return math.isfinite(value)
    try:
        return kind is int and math.isfinite(value)
    except OverflowError:  # an integer past float's range
        return False


COUNT = Kind("a whole number >= 0", lambda v: type(v) is int and 0 <= v < MAX_COUNT)
SECONDS = Kind("a finite number >= 0", lambda v: _finite(v) and v >= 0)
AMOUNT = Kind("a finite number >= 0 or null", lambda v: v is None or (_finite(v) and v >= 0))
VALUE = Kind("a finite number or null", lambda v: v is None or _finite(v))
NUMBER = Kind("a number or null", lambda v: v is None or _is_number(v))
FINITE = Kind("a finite number", _finite)
POSITIVE = Kind("a finite number > 0", lambda v: _finite(v) and v > 0)
FLAG = Kind("true or false", lambda v: type(v) is bool)
NAME = Kind("a name", lambda v: isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS)
# Where a resumed process loaded its state from: its own in-memory checkpoint ("snapshot"), its
# partner's copy of it (its host was replaced), or the newest checkpoint on disk.
RESUMED_FROM = ("snapshot", "partner", "checkpoint")
SOURCE = Kind(
    "'snapshot', 'partner' or 'checkpoint'", lambda v: type(v) is str and v in RESUMED_FROM
)


def _kind(kind: Kind) -> dict[str, Kind]:
    return {KIND: kind}


# --- metrics.jsonl --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """What the trainer records of every step, in the order of its line; ``measured`` follows."""

    step: int = field(metadata=_kind(COUNT))
    loss: float = field(metadata=_kind(VALUE))  # null: not finite
    grad_norm: float = field(metadata=_kind(AMOUNT))  # null: not finite (the step was skipped)
    lr: float = field(metadata=_kind(AMOUNT))
    tokens_per_s: float = field(metadata=_kind(AMOUNT))
    tokens_per_s_per_device: float = field(metadata=_kind(AMOUNT))
    mfu: float | None = field(metadata=_kind(AMOUNT))  # null: no peak FLOP/s known
    peak_memory_gib: float = field(metadata=_kind(AMOUNT))
    step_time_s: float = field(metadata=_kind(SECONDS))  # the whole iteration
    skipped: bool = field(metadata=_kind(FLAG))  # the non-finite guard skipped the update
    skipped_steps: int = field(metadata=_kind(COUNT))  # the run's so far
    time: float = field(metadata=_kind(SECONDS))  # when it was recorded: time.time()
    stage: int = field(metadata=_kind(COUNT))  # the data-mix stage of the step's samples, from 0
    tokens: int = field(metadata=_kind(COUNT))  # the run's tokens trained on through this step
    # Keys of MEASURED and any other number or null, in the order measured.
    measured: Mapping[str, float | int | str | None] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The record's object, non-finite numbers still in (``nonfinite_as_null`` writes)."""
        record: dict[str, Any] = {name: getattr(self, name) for name in RECORD_KEYS}
        record.update(self.measured)
        return record


RECORD_KEYS = tuple(f.name for f in fields(StepRecord) if KIND in f.metadata)
# The measured keys a reader may ask for, with their kinds. The diagnostics' others (loss_z,
# frozen_fraction, max_attention_logit, ...) and the evals' (heldout_loss, acc/<task>, ...) pass.
MEASURED = {
    "expert_load_imbalance": AMOUNT,  # a mixture of experts: the worst layer's max over mean
    "dropped_tokens": COUNT,  # token-to-expert assignments the capacity dropped
    "gns": NUMBER,  # gradient noise scale in tokens (diagnose batch-size bounds it)
    "startup_s": AMOUNT,  # only on the first step of a process: start to first step
    "data_time_s": AMOUNT,  # the parts of step_time_s the loop timed
    "checkpoint_stall_s": AMOUNT,
    "checkpoint_load_s": AMOUNT,
    "snapshot_stall_s": AMOUNT,  # an in-memory checkpoint held the step: its copy, its settling
    # Only on a resumed process's first step: where its state came from, and which step's.
    "resumed_from": SOURCE,
    "resumed_step": COUNT,
    "eval_time_s": AMOUNT,  # after the step, outside step_time_s, before time
    # Busy time (train/monitor/stragglers.py): over ranks, the step's least, median and most, and
    # the rank (and its host) with the most; on the step of a straggler warning, the rank it names
    # and its ratio to the median over the window.
    "busy_s_min": SECONDS,
    "busy_s_median": SECONDS,
    "busy_s_max": SECONDS,
    "busy_slowest_rank": COUNT,
    "busy_slowest_host": NAME,
    "straggler_rank": COUNT,
    "straggler_ratio": SECONDS,
}
STEP_KEYS: dict[str, Kind] = {
    **{f.name: f.metadata[KIND] for f in fields(StepRecord) if KIND in f.metadata},
    **MEASURED,
}


@dataclass(frozen=True, slots=True)
class StepLine:
    """One parsed line of ``metrics.jsonl``: its keys of ``STEP_KEYS`` hold their kinds."""

    where: str  # "FILE:LINE"
    step: int
    raw: Mapping[str, Any]  # the line's object

    @property
    def line(self) -> int:
        return int(self.where.rpartition(":")[2])

    @overload
    def number(self, key: str) -> float | None: ...
    @overload
    def number(self, key: str, default: float) -> float: ...
    def number(self, key: str, default: float | None = None) -> float | None:
        """``key``'s number as a float (an integer past float's range: infinite); ``default``
        when it is null or absent."""
        value: Any = self.raw.get(key)
        if not _is_number(value):
            return default
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf

    def numbers(self) -> dict[str, float]:
        """Every finite number of the line (not ``true``/``false``), by key."""
        return {key: float(value) for key, value in self.raw.items() if _finite(value)}


def parse_step(
    raw: Mapping[str, Any], where: str, *, require: Collection[str] = (), fix: str = FIX
) -> StepLine:
    """The step of one ``metrics.jsonl`` object, or a ``GoodputError`` naming ``where``; the
    keys of ``require`` must be there (null where their kind admits it)."""
    _check(raw, STEP_KEYS, ("step", *require), where, fix)
    return StepLine(where, raw["step"], raw)


def read_steps(
    path: Path, *, require: Collection[str] = (), fix: str = FIX, max_lines: int = MAX_LINES
) -> Iterator[StepLine]:
    """Every whole line of the ``metrics.jsonl`` at ``path``, in order (a step run again
    appears again); the file must be there."""
    assert set(require) <= STEP_KEYS.keys(), require
    for where, raw in read_json_lines(path, rundir.MAX_LINE_BYTES, fix=fix, max_lines=max_lines):
        yield parse_step(raw, where, require=require, fix=fix)


def nonfinite_as_null(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with each float that is not finite as None: what JSON can hold."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }


def json_line(record: Mapping[str, Any], *, where: object) -> str:
    """``record`` as one line of a run file (strict JSON, its newline)."""
    return json_text(record, where=where) + "\n"


# --- evals.jsonl ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalLine:
    """One eval metric of the weights of ``step``: ``task`` a held-out corpus
    (``heldout/<corpus>``), a multiple-choice or an lm-eval task; ``source`` ``"train"`` (the
    loop) or ``"goodput eval"``; ``time`` when it was written (absent from old lines)."""

    step: int
    task: str
    metric: str
    value: float | None  # None: not finite
    stderr: float | None  # None: the metric has none, or not finite
    source: str
    time: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "task": self.task,
            "metric": self.metric,
            "value": _finite_or_none(self.value),
            "stderr": _finite_or_none(self.stderr),
            "source": self.source,
            "time": self.time,
        }


EVAL_KEYS = {
    "step": COUNT,
    "task": NAME,
    "metric": NAME,
    "value": VALUE,
    "stderr": AMOUNT,  # a standard error: never below 0
    "source": NAME,
    "time": SECONDS,
}
EVAL_REQUIRED = ("step", "task", "metric", "value", "stderr", "source")


def read_evals(path: Path, *, fix: str = FIX, max_lines: int = MAX_LINES) -> Iterator[EvalLine]:
    """Every whole line of the ``evals.jsonl`` at ``path``, in order; the file must be there."""
    for where, raw in read_json_lines(path, rundir.MAX_LINE_BYTES, fix=fix, max_lines=max_lines):
        yield parse_eval(raw, where, fix=fix)


def evals_text(lines: Iterable[EvalLine], *, where: object) -> str:
    """``lines`` as they are appended to ``evals.jsonl``, in one piece."""
    return "".join(json_line(line.as_json(), where=where) for line in lines)


def parse_eval(raw: Mapping[str, Any], where: str, *, fix: str = FIX) -> EvalLine:
    """The metric of one ``evals.jsonl`` object, or a ``GoodputError`` naming ``where``."""
    _check(raw, EVAL_KEYS, EVAL_REQUIRED, where, fix)
    value, stderr, time = raw["value"], raw["stderr"], raw.get("time")
    return EvalLine(
        step=raw["step"],
        task=raw["task"],
        metric=raw["metric"],
        value=None if value is None else float(value),
        stderr=None if stderr is None else float(stderr),
        source=raw["source"],
        time=None if time is None else float(time),
    )


# --- busy.jsonl -----------------------------------------------------------------------------

SLOWEST = 8  # the slowest ranks a busy.jsonl line names, at most: the one definition
QUANTILES = ("min", "p25", "median", "p75", "max")  # of a line's ``quantiles``, in order
OLD_BUSY_FIX = (
    "keep only this goodput's lines: in the run directory, grep -F '\"quantiles\"' busy.jsonl "
    "> busy.new && mv busy.new busy.jsonl"
)


@dataclass(frozen=True, slots=True)
class RankBusy:
    """A rank's mean busy time a step over a window, and its host."""

    rank: int
    host: str
    mean_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class BusyLine:
    """The window of ``steps`` steps that ended at ``step``, over the ``ranks`` ranks judged:
    the ``QUANTILES`` of the ranks' mean busy time a step, and the slowest ranks, slowest
    first."""

    step: int
    steps: int
    ranks: int
    quantiles: tuple[float, float, float, float, float]
    slowest: tuple[RankBusy, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "steps": self.steps,
            "ranks": self.ranks,
            "quantiles": list(self.quantiles),
            "slowest": [[r.rank, r.host, r.mean_s] for r in self.slowest],
        }


def read_busy(path: Path, *, fix: str = FIX, max_lines: int = MAX_LINES) -> Iterator[BusyLine]:
    """Every whole line of the ``busy.jsonl`` at ``path``, in order; the file must be there."""
    for where, raw in read_json_lines(path, rundir.MAX_LINE_BYTES, fix=fix, max_lines=max_lines):
        yield parse_busy(raw, where, fix=fix)


def parse_busy(raw: Mapping[str, Any], where: str, *, fix: str = FIX) -> BusyLine:
    """The window of one ``busy.jsonl`` object, or a ``GoodputError`` naming ``where``."""
    if "hosts" in raw and "quantiles" not in raw:
        # A row per host (goodput before issue 41): it holds no ranks to name, so no line of
        # this shape can be made of it without inventing them.
        what = "is a busy line of an older goodput, a row per host"
        raise GoodputError(where, what, OLD_BUSY_FIX)
    _check(raw, BUSY_KEYS, BUSY_KEYS, where, fix)
    if len(raw) != len(BUSY_KEYS):
        raise GoodputError(where, f"has keys other than {', '.join(BUSY_KEYS)}", fix)
    quantiles = raw["quantiles"]
    if not (
        len(quantiles) == len(QUANTILES)
        and all(SECONDS.admits(value) for value in quantiles)
        and all(a <= b for a, b in zip(quantiles, quantiles[1:], strict=False))
    ):
        what = f"'quantiles' is not [{', '.join(QUANTILES)}]: finite seconds >= 0, nondecreasing"
        raise GoodputError(where, what, fix)
    low, high = float(quantiles[0]), float(quantiles[-1])
    rows = raw["slowest"]
    ranks = raw["ranks"]
    most = min(SLOWEST, ranks)
    if not 0 < len(rows) <= most:
        raise GoodputError(where, f"'slowest' does not name 1 to {most} ranks", fix)
    slowest = tuple(
        _rank_busy(row, ranks, low, high, f"{where}: slowest[{i}]", fix)
        for i, row in enumerate(rows)
    )
    if len({r.rank for r in slowest}) != len(slowest):
        raise GoodputError(where, "'slowest' names a rank twice", fix)
    if any(a.mean_s < b.mean_s for a, b in zip(slowest, slowest[1:], strict=False)):
        raise GoodputError(where, "'slowest' is not slowest first (mean_s nonincreasing)", fix)
    if slowest[0].mean_s != high:
        what = f"slowest[0]'s mean_s {slowest[0].mean_s:g} is not the max {high:g}"
        raise GoodputError(where, what, fix)
    return BusyLine(
        step=raw["step"],
        steps=raw["steps"],
        ranks=ranks,
        quantiles=(low, float(quantiles[1]), float(quantiles[2]), float(quantiles[3]), high),
        slowest=slowest,
    )


def _rank_busy(row: Any, ranks: int, low: float, high: float, where: str, fix: str) -> RankBusy:
    if not (
        isinstance(row, list)
        and len(row) == 3
        and COUNT.admits(row[0])
        and row[0] < ranks
        and NAME.admits(row[1])
        and SECONDS.admits(row[2])
    ):
        what = f"is not [rank, host, mean_s]: a rank below {ranks}, a name, finite seconds >= 0"
        raise GoodputError(where, what, fix)
    busy = RankBusy(row[0], row[1], float(row[2]))
    if not low <= busy.mean_s <= high:
        what = f"mean_s {busy.mean_s:g} is not within the min {low:g} and the max {high:g}"
        raise GoodputError(where, what, fix)
    return busy


WHOLE = Kind("a whole number >= 1", lambda v: type(v) is int and 1 <= v < MAX_COUNT)
BUSY_KEYS = {
    "step": COUNT,
    "steps": WHOLE,
    "ranks": WHOLE,
    "quantiles": Kind("a list", lambda v: isinstance(v, list)),
    "slowest": Kind("a list", lambda v: isinstance(v, list)),
}


# --- run.json's data stages -----------------------------------------------------------------

MAX_STAGES = 1000  # stages of one run's record (the config admits far fewer)
MAX_CORPORA = 10_000  # corpora of one stage
SHARE = Kind("a number from 0 to 1", lambda v: _finite(v) and 0 <= v <= 1)
PATH = Kind("a path", lambda v: isinstance(v, str) and 0 < len(v) <= 4096)
STAGE_KEYS = {
    "start_step": COUNT,
    "file_list": PATH,
    "corpora": Kind("a list", lambda v: isinstance(v, list)),
}
SHARE_KEYS = {"corpus": NAME, "target": SHARE, "achieved": SHARE, "wrapped": FLAG}


@dataclass(frozen=True, slots=True)
class CorpusShare:
    """A corpus in one stage: its target share of the stage's samples, the share it got, and
    whether the stage read some of it a second time (the corpus ran out and wrapped)."""

    corpus: str
    target: float
    achieved: float
    wrapped: bool


@dataclass(frozen=True, slots=True)
class StageMixture:
    """One data-mix stage as ``run.json`` records it (``data.stages``, written by the trainer
    from its blend's manifest): the step it starts after (0: the first), its file list, and
    its corpora's shares. A run without stages records one, from step 0."""

    start_step: int
    file_list: str
    corpora: tuple[CorpusShare, ...]

    def as_json(self) -> dict[str, Any]:
        rows = [
            {"corpus": c.corpus, "target": c.target, "achieved": c.achieved, "wrapped": c.wrapped}
            for c in self.corpora
        ]
        return {"start_step": self.start_step, "file_list": self.file_list, "corpora": rows}


def stage_mixtures(manifest: Mapping[str, Any], step_samples: int) -> list[StageMixture]:
    """The stages of a built blend's manifest (``blend.json``'s ``stages`` and their reports),
    ``step_samples`` samples to a step."""
    return [
        StageMixture(
            start_step=stage["start_sample"] // step_samples,
            file_list=str(stage["file_list"]),
            corpora=tuple(
                CorpusShare(row["name"], row["target"], row["achieved"], row["wrapped"])
                for row in stage["report"]["corpora"]
            ),
        )
        for stage in manifest["stages"]
    ]


def read_stage_mixtures(record: Any, where: str, *, fix: str = FIX) -> list[StageMixture]:
    """``data.stages`` of a ``run.json`` object: [] when it has none (an older goodput's), or
    a ``GoodputError`` naming ``where`` and the stage."""
    data = record.get("data") if isinstance(record, dict) else None
    stages = data.get("stages") if isinstance(data, dict) else None
    if stages is None:
        return []
    if not isinstance(stages, list) or len(stages) > MAX_STAGES:
        raise GoodputError(where, f"'data.stages' is not a list of at most {MAX_STAGES}", fix)
    return [_stage(stage, f"{where}: data.stages[{i}]", fix) for i, stage in enumerate(stages)]


def _stage(raw: Any, where: str, fix: str) -> StageMixture:
    if not isinstance(raw, dict):
        raise GoodputError(where, "is not an object", fix)
    _check(raw, STAGE_KEYS, STAGE_KEYS, where, fix)
    rows = raw["corpora"]
    if len(rows) > MAX_CORPORA:
        raise GoodputError(where, f"has more than {MAX_CORPORA} corpora", fix)
    shares = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise GoodputError(f"{where}.corpora[{i}]", "is not an object", fix)
        _check(row, SHARE_KEYS, SHARE_KEYS, f"{where}.corpora[{i}]", fix)
        shares.append(CorpusShare(row["corpus"], row["target"], row["achieved"], row["wrapped"]))
    return StageMixture(raw["start_step"], raw["file_list"], tuple(shares))


# --- all ------------------------------------------------------------------------------------


def _check(
    raw: Mapping[str, Any], kinds: Mapping[str, Kind], require: Iterable[str], where: str, fix: str
) -> None:
    for key in require:
        if key not in raw:
            raise GoodputError(where, f"{key!r} is missing, not {kinds[key].what}", fix)
    for key, value in raw.items():
        kind = kinds.get(key)
        if kind is not None and not kind.admits(value):
            raise GoodputError(where, f"{key!r} is {_shown(value)}, not {kind.what}", fix)


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _shown(value: Any) -> str:
    if value is None or isinstance(value, str | int | float | bool):
        text = json.dumps(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return "an object" if isinstance(value, dict) else "an array"


def read_tokens_per_step(config: Path) -> int:
    """``[train] tokens_per_step`` of a run's ``config.toml``."""
    train = read_toml(config).get("train")
    value = train.get("tokens_per_step") if isinstance(train, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NUMBER:
        raise GoodputError.usage(
            config,
            f"[train] tokens_per_step is {value!r}, not a whole number in [1, 2**53]",
            "pass a goodput run directory: its config.toml is the resolved run config",
        )
    return value
