"""Runs compared at matched tokens: ``goodput report RUN_A RUN_B ...`` (two or more runs).

Owns ``compare_runs`` (run directories -> ``Comparison``), the series each run is compared on,
and the pure functions under them: ``tokens_by_step`` (the tokens axis), ``trailing_mean`` (the
training loss's smoothing) and ``first_reach`` (where one run first reaches another's final
value).

The axis is tokens seen, not steps, so that runs of other batch sizes, data-parallel or tensor
layouts, job chains and data-mix stages line up. A step line's ``tokens`` (cumulative tokens
through the step) places it; a line without it (a run older than the key) is placed at step x
``[train] tokens_per_step`` of the run's ``config.toml``, and the run is marked ``derived``.
Each run is read by the run report's reader (``run_files.read_run``: strict, bounded, a torn last
line left out) and each step's *last* run is kept (``plots.kept_and_lost``: a step recomputed
after a failure counts once, as the weights kept it). Tokens must rise with the step; a run
whose do not is refused, naming the line.

Series: ``loss`` (the training loss, a trailing mean over a window of 1/50 of the shortest
run's tokens, so that one noisy step does not decide where a run "reaches" a value; the raw
points are kept beside it), ``heldout/<corpus>`` (the held-out loss, ``plots.heldout_losses``)
and ``acc/<task>`` (each multiple-choice task's accuracy in ``evals.jsonl``); where a step's
``stage`` changes, a data-mix stage began (the figures mark it). A loss is reached
at or below the target, an accuracy at or above it. An eval at a step with no metrics line is
placed by ``tokens_per_step``, or left out (counted) when the run has no config to say it.

It reads the runs and writes nothing; the views are ``compare_views``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from goodput import rundir, runfiles
from goodput.errors import GoodputError
from goodput.report.plots import heldout_losses, kept_and_lost
from goodput.report.run_files import TOKENS, RunFiles, Step, read_run
from goodput.report.sums import headroom, mean_of

MAX_RUNS = 10  # one colour each in the figures (matplotlib's tab10)
SMOOTHING_FRACTION = 1 / 50  # of the shortest run's tokens: the training loss's window
LOSS = "loss"
TOKENS_FIX = "it is not what goodput train wrote; restore the file or leave the run out"

Point = tuple[int, float]  # (tokens seen, value)


@dataclass(frozen=True, slots=True)
class Series:
    """One value of a run over tokens seen, tokens strictly rising; ``raw``: the points before
    smoothing (the training loss only)."""

    name: str
    points: tuple[Point, ...]
    higher_is_better: bool = False
    raw: tuple[Point, ...] | None = None

    def __post_init__(self) -> None:
        # Every verdict (a final value, where a run reaches it) is read off the points: the
        # readers admit only finite values and the trailing mean stays finite.
        assert all(math.isfinite(value) for _, value in self.points), self.name

    @property
    def final(self) -> Point:
        return self.points[-1]


@dataclass(frozen=True, slots=True)
class ComparedRun:
    label: str  # how tables and legends name it: the folder's name, its path when names repeat
    run_dir: Path
    tokens_derived: bool  # some step placed at step x tokens_per_step (no "tokens" in its line)
    series: dict[str, Series]
    evals_left_out: int = 0  # eval points at a step no metrics line or config places
    stage_starts: tuple[int, ...] = ()  # tokens seen when each data-mix stage after the first began


@dataclass(frozen=True, slots=True)
class Reach:
    """Where run ``run`` first reaches run ``target_run``'s final ``series`` value ``target``
    (``tokens``; None: never), against the ``target_tokens`` that run took to get there."""

    series: str
    run: str
    target_run: str
    target: float
    tokens: int | None
    target_tokens: int

    @property
    def ratio(self) -> float | None:
        """How many times fewer tokens ``run`` needed (below 1: more)."""
        return None if not self.tokens else self.target_tokens / self.tokens


@dataclass(frozen=True, slots=True)
class Comparison:
    runs: list[ComparedRun]
    smoothing_tokens: int  # the training loss's trailing window
    reaches: list[Reach] = field(default_factory=list)

    def series_names(self) -> list[str]:
        return series_names(self.runs)


def series_names(runs: Sequence[ComparedRun]) -> list[str]:
    """Every series some run has, the training loss first."""
    names = {name for run in runs for name in run.series}
    return sorted(names, key=lambda name: (name != LOSS, name))


# --- the pure functions ---------------------------------------------------------------------


def tokens_by_step(
    steps: Sequence[Step], tokens_per_step: int | None, where: object
) -> tuple[dict[int, int], bool]:
    """Each kept step's tokens seen (``steps`` by step, one each) and whether any was derived
    from ``tokens_per_step``; a ``GoodputError`` when tokens do not rise with the step, or a
    line lacks them and there is no ``tokens_per_step``. Integers throughout: exact at any
    count the lines admit (``runfiles.MAX_COUNT``), past 2**53 too."""
    placed: dict[int, int] = {}
    derived, last = False, (0, 0)  # (step, tokens) of the line before
    for step in steps:
        tokens = step.tokens_seen
        if tokens is None:
            if tokens_per_step is None:
                raise _no_tokens_per_step(where)
            tokens, derived = step.step * tokens_per_step, True
        if not last[1] < tokens < runfiles.MAX_COUNT:
            raise GoodputError(
                f"{where}:{step.line}",
                f"'tokens' is {tokens:,} at step {step.step}, not a whole number above the "
                f"{last[1]:,} of step {last[0]} and below {runfiles.MAX_COUNT:,}: tokens seen "
                "must rise with the step",
                TOKENS_FIX,
            )
        placed[step.step], last = tokens, (step.step, tokens)
    return placed, derived


def trailing_mean(points: Sequence[Point], window: int) -> tuple[Point, ...]:
    """Each point's value as the mean of the points in the ``window`` tokens up to it (its own
    included): ``points`` have strictly rising tokens and finite values, ``window`` >= 1. A
    running sum (a run may have millions of steps), of the values scaled so that it cannot
    overflow (``sums.headroom``: the values may be as large as float's largest): exact for a
    window of one point, else within rounding of the largest value since the window last held
    one point; finite."""
    assert window >= 1, window
    if not points:
        return ()
    scale = headroom(max(abs(value) for _, value in points), len(points))
    smoothed: list[Point] = []
    total, start = 0.0, 0
    for tokens, value in points:
        total += value * scale
        while points[start][0] <= tokens - window:
            total -= points[start][1] * scale
            start += 1
        count = len(smoothed) + 1 - start
        if count == 1:
            total = value * scale  # the running sum's rounding, dropped at a window of one point
            smoothed.append((tokens, value))
        else:
            smoothed.append((tokens, mean_of(total, count, scale)))
    return tuple(smoothed)


def first_reach(points: Sequence[Point], target: float, *, higher_is_better: bool) -> int | None:
    """The tokens of the first point whose value is at or past ``target`` (at or below it for a
    loss, at or above for an accuracy); None when none is."""
    for tokens, value in points:
        if (value >= target) if higher_is_better else (value <= target):
            return tokens
    return None


def reaches(runs: Sequence[ComparedRun]) -> list[Reach]:
    """For each series and each ordered pair of runs that both have it: where the first run
    first reaches the second's final value."""
    found = []
    for name in series_names(runs):
        having = [run for run in runs if name in run.series]
        for run in having:
            for other in having:
                if other is run:
                    continue
                series, target = run.series[name], other.series[name]
                value = target.final[1]
                tokens = first_reach(series.points, value, higher_is_better=series.higher_is_better)
                found.append(Reach(name, run.label, other.label, value, tokens, target.final[0]))
    return found


# --- reading the runs -----------------------------------------------------------------------


def compare_runs(run_dirs: Sequence[Path]) -> Comparison:
    """The runs at ``run_dirs`` (two to ``MAX_RUNS``, each once) on one tokens axis."""
    _check_run_dirs(run_dirs)
    labels = _labels(run_dirs)
    loaded = [_load(run_dir, label) for run_dir, label in zip(run_dirs, labels, strict=True)]
    shortest = min(run.series[LOSS].final[0] for run in loaded)
    window = max(1, round(shortest * SMOOTHING_FRACTION))
    runs = [_smoothed(run, window) for run in loaded]
    return Comparison(runs, window, reaches(runs))


def _check_run_dirs(run_dirs: Sequence[Path]) -> None:
    if not 2 <= len(run_dirs) <= MAX_RUNS:
        raise GoodputError.usage(
            "goodput report", f"compares 2 to {MAX_RUNS} runs, not {len(run_dirs)}", "pass fewer"
        )
    seen: dict[str, Path] = {}
    for run_dir in run_dirs:
        key = os.path.realpath(run_dir)
        if key in seen:
            raise GoodputError.usage(
                run_dir, f"is the same run as {seen[key]}", "name each run once"
            )
        seen[key] = run_dir


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    names = [run_dir.resolve().name for run_dir in run_dirs]
    unique = len(set(names)) == len(names) and all(names)
    return names if unique else [str(run_dir) for run_dir in run_dirs]


def _load(run_dir: Path, label: str) -> ComparedRun:
    run = read_run(run_dir)
    kept, _ = kept_and_lost(run.steps)
    metrics = run_dir / rundir.METRICS
    evals = _eval_series(run)
    unplaced = {s for _, by_step, _ in evals for s in by_step} - {step.step for step in kept}
    needs_config = bool(unplaced) or any(step.tokens_seen is None for step in kept)
    tokens_per_step = _tokens_per_step(run_dir) if needs_config else None
    placed, derived = tokens_by_step(kept, tokens_per_step, metrics)
    loss = [(placed[s.step], s.values[LOSS]) for s in kept if LOSS in s.values]
    if not loss:
        raise GoodputError.usage(
            metrics,
            "holds no step with a finite loss: nothing to compare",
            "pass a run that trained",
        )
    series = {LOSS: Series(LOSS, tuple(loss), raw=tuple(loss))}
    left_out = 0
    for name, by_step, higher in evals:
        points, missed = _placed(by_step, placed, tokens_per_step)
        left_out += missed
        if points:
            series[name] = Series(name, points, higher_is_better=higher)
    return ComparedRun(label, run_dir, derived, series, left_out, _stage_starts(kept, placed))


def _stage_starts(kept: Sequence[Step], placed: dict[int, int]) -> tuple[int, ...]:
    """The tokens seen before each step whose ``stage`` differs from the step before's."""
    starts, before = [], None
    for previous, step in zip(kept, kept[1:], strict=False):
        stage = step.values.get("stage")
        before = previous.values.get("stage", before)
        if stage is not None and before is not None and stage != before:
            starts.append(placed[previous.step])
    return tuple(starts)


def _eval_series(run: RunFiles) -> list[tuple[str, dict[int, float], bool]]:
    """(series name, step -> value, higher is better) of the held-out losses and accuracies."""
    found = [
        (f"heldout/{corpus}", dict(points), False) for corpus, points in heldout_losses(run).items()
    ]
    accuracy: dict[str, dict[int, float]] = {}
    for line in run.evals:  # the later line for a step says last
        if line.metric == "acc" and line.value is not None:
            accuracy.setdefault(line.task, {})[line.step] = line.value
    found += [(f"acc/{task}", by_step, True) for task, by_step in sorted(accuracy.items())]
    return found


def _placed(
    by_step: dict[int, float], placed: dict[int, int], tokens_per_step: int | None
) -> tuple[tuple[Point, ...], int]:
    """An eval's points on the tokens axis, and how many no line or config places."""
    points, missed = [], 0
    for step, value in sorted(by_step.items()):
        tokens = placed.get(step)
        if tokens is None and tokens_per_step is not None:
            tokens = step * tokens_per_step
        if tokens is None:
            missed += 1
        else:
            points.append((tokens, value))
    points.sort()
    unique = {tokens: value for tokens, value in points}  # a step and a derived one may meet
    return tuple(unique.items()), missed


def _tokens_per_step(run_dir: Path) -> int | None:
    """``[train] tokens_per_step`` of the run's ``config.toml``; None when there is none."""
    config = run_dir / rundir.CONFIG
    return runfiles.read_tokens_per_step(config) if os.path.lexists(config) else None


def _no_tokens_per_step(where: object) -> GoodputError:
    return GoodputError(
        where,
        f"has steps without '{TOKENS}' and the run has no {rundir.CONFIG} to place them "
        "([train] tokens_per_step)",
        "restore the run's config.toml, or leave the run out",
    )


def _smoothed(run: ComparedRun, window: int) -> ComparedRun:
    loss = run.series[LOSS]
    smooth = Series(LOSS, trailing_mean(loss.points, window), raw=loss.points)
    return replace(run, series={**run.series, LOSS: smooth})
