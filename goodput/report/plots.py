"""The run report's figures: each a function of (``RunFiles``, ``Accounting``) that returns one
small PNG's bytes, or None when the run holds no data for it (no evals yet, no blend report, no
LR-finder curve, ...). ``PLOTS`` lists them in the page's order with their titles and captions.

Training curves are over steps and show each step's *last* run (the one the weights kept, as
``accounting`` counts it); the earlier runs of recomputed steps, lost to a failure, are drawn
as faint grey points on the loss plot. The timeline is over wall-clock hours since the run's
start (``Accounting.start``). A series over steps or windows is drawn decimated
(``figures.extremes``, ``figures.envelope``: at most a few thousand points, each bucket's
extremes kept), so that 100,000 steps draw as fast as 2,000 and look the same.

Figures come from ``goodput.figures.agg_figure`` (matplotlib's Agg canvas, imported only
there) and are 8 x 3.5 in (the badput bar 8 x 2.2) at 100 dpi, so that a page of them stays
light. Names from the run (corpora, tasks) are drawn as plain text: ``$`` is escaped, since
matplotlib reads ``$...$`` as math and raises on math it cannot parse. Every number a run file
admits is drawn: an axis of numbers past ``figures.MAX_DRAWN`` divides them by a power of ten
its label names (``figures.axis_scale``), and the accuracy axis draws a value past
``ACCURACY_BAND`` at its edge. Checkpoint ticks take their step's time from the account's
timeline (a step it left out has none to trust). Nothing here writes a file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

from goodput.figures import agg_figure, axis_scale, envelope, extremes, png_bytes
from goodput.report.accounting import CAUSES, Accounting
from goodput.report.run_files import RunFiles, Step
from goodput.runfiles import SLOWEST, BusyLine

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

WIDTH_IN, HEIGHT_IN = 8.0, 3.5
MAX_LABEL = 40  # characters of an outside name shown in a figure
LOG_SPAN = 100.0  # a positive series spanning more than this factor is drawn on a log axis
# An accuracy axis shows [0, 1]: a value (or its error bar, or a chance line) past this band is
# drawn at its edge, off the axis as it would be anyway, so that matplotlib never sees 1e308.
ACCURACY_BAND = (-1.0, 2.0)
BUSY_RANKS = 6  # the ranks named slowest most often, each drawn and named on its own
STAGES_PER_ROW = 3  # panels of the data-mix stages figure
STAGES_DRAWN = 12  # the first ones; the page's table lists every stage
# Hex colours, so that the HTML page's swatches are the figures' own.
CLASS_COLOURS = {
    "success": "#2ca02c",
    "walltime": "#1f77b4",
    "interrupted": "#ff7f0e",
    "bad-node": "#d62728",
    "hang": "#9467bd",
    "stuck-pre-training": "#8c564b",
    "straggler": "#e377c2",
    "error": "#444444",
    "running": "#17becf",
    "unrecorded": "#bcbd22",
}
# Where an attempt's end is a failure of the run (walltime: the job chain's planned end).
FAILED_CLASSES = frozenset({"interrupted", "bad-node", "hang", "stuck-pre-training", "error"})
CAUSE_COLOURS = {
    "productive": "#2ca02c",
    "startup": "#1f77b4",
    "checkpoint_load": "#aec7e8",
    "data": "#ff7f0e",
    "checkpoint_save": "#ffbb78",
    "snapshot": "#17becf",
    "eval": "#9467bd",
    "recomputed": "#d62728",
    "not_checkpointed": "#ff9896",
    "hang": "#8c564b",
    "shutdown": "#c49c94",
    "failed_start": "#e377c2",
    "in_process_recovery": "#7f7f7f",
    "backoff": "#bcbd22",
    "queue": "#dbdb8d",
    "other": "#c7c7c7",
}
assert set(CAUSE_COLOURS) == {"productive", *CAUSES}


@dataclass(frozen=True, slots=True)
class Plot:
    name: str  # stable id (the page's anchor)
    title: str
    caption: str
    draw: Callable[[RunFiles, Accounting], bytes | None]


def kept_and_lost(steps: list[Step]) -> tuple[list[Step], list[Step]]:
    """(each step number's last run, by step; the earlier runs of recomputed steps, by time)."""
    last = {step.step: index for index, step in enumerate(steps)}
    kept = sorted((steps[index] for index in last.values()), key=attrgetter("step"))
    lost = sorted((s for i, s in enumerate(steps) if last[s.step] != i), key=attrgetter("time"))
    return kept, lost


def loss_plot(run: RunFiles, acc: Accounting) -> bytes | None:
    """The training loss (kept runs; lost runs grey) and the held-out loss per corpus."""
    kept, lost = kept_and_lost(run.steps)
    train, recomputed = _series(kept, "loss"), _series(lost, "loss")
    heldout = heldout_losses(run)
    if not train[0] and not heldout:
        return None
    scale = axis_scale(
        [*train[1], *recomputed[1], *(loss for points in heldout.values() for _, loss in points)]
    )
    figure, axes = report_figure()
    if train[0]:
        axes.plot(
            *extremes(train[0], scale.drawn(train[1])), color="#333333", linewidth=1,
            label="training loss",
        )  # fmt: skip
    if recomputed[0]:
        axes.scatter(
            recomputed[0], scale.drawn(recomputed[1]), s=4, color="gray", alpha=0.5,
            label="lost runs of recomputed steps",
        )  # fmt: skip
    for corpus, points in heldout.items():
        label = f"held-out: {plain_label(corpus)}"
        steps, losses = zip(*points, strict=True)
        axes.plot(steps, scale.drawn(losses), marker="o", markersize=3, label=label)
    axes.set_xlabel("step")
    axes.set_ylabel(scale.label("loss"))
    axes.legend(fontsize="small")
    return png_bytes(figure)


def heldout_losses(run: RunFiles) -> dict[str, list[tuple[int, float]]]:
    """corpus -> (step, held-out loss), by step: the step records' ``heldout_loss/<corpus>``,
    then the ``heldout/<corpus>`` loss lines of ``evals.jsonl`` (the later says last)."""
    found: dict[str, dict[int, float]] = {}
    # Steps' lines mostly hold the same keys: each set of keys is searched once, not each line.
    heldout_keys: dict[tuple[str, ...], list[str]] = {}
    for step in run.steps:
        keys = tuple(step.values)
        if keys not in heldout_keys:
            heldout_keys[keys] = [key for key in keys if key.startswith("heldout_loss/")]
        for key in heldout_keys[keys]:
            found.setdefault(key.removeprefix("heldout_loss/"), {})[step.step] = step.values[key]
    for line in run.evals:
        if line.task.startswith("heldout/") and line.metric == "loss" and line.value is not None:
            found.setdefault(line.task.removeprefix("heldout/"), {})[line.step] = line.value
    return {corpus: sorted(points.items()) for corpus, points in sorted(found.items())}


def grad_norm_plot(run: RunFiles, acc: Accounting) -> bytes | None:
    return _step_series_plot(run, "grad_norm", "gradient norm", "tab:orange")


def lr_plot(run: RunFiles, acc: Accounting) -> bytes | None:
    return _step_series_plot(run, "lr", "learning rate", "tab:green")


def throughput_plot(run: RunFiles, acc: Accounting) -> bytes | None:
    """tokens/s on the left axis, MFU (%) on the right, over the kept steps."""
    kept, _ = kept_and_lost(run.steps)
    rate, mfu = _series(kept, "tokens_per_s"), _series(kept, "mfu")
    if not rate[0] and not mfu[0]:
        return None
    figure, axes = report_figure()
    axes.set_xlabel("step")
    if rate[0]:
        scale = axis_scale(rate[1])
        axes.plot(*extremes(rate[0], scale.drawn(rate[1])), color="tab:blue", linewidth=1)
        axes.set_ylabel(scale.label("tokens/s"), color="tab:blue")
    if mfu[0]:
        right = axes.twinx() if rate[0] else axes
        scale = axis_scale(mfu[1])  # of the fractions: 100 x 1e308 would not be finite
        percent = [100 * value for value in scale.drawn(mfu[1])]
        right.plot(*extremes(mfu[0], percent), color="tab:red", linewidth=1)
        right.set_ylabel(scale.label("MFU (%)"), color="tab:red")
    return png_bytes(figure)


def accuracy_plot(run: RunFiles, acc: Accounting) -> bytes | None:
    """Each multiple-choice task's accuracy over steps (± its stderr), its chance line dashed
    in the same colour."""
    scores: dict[str, dict[int, tuple[float, float]]] = {}
    chance: dict[str, float] = {}
    for line in run.evals:
        if line.value is None:
            continue
        if line.metric == "acc":
            value, stderr = _in_band(line.value), min(line.stderr or 0.0, ACCURACY_BAND[1])
            scores.setdefault(line.task, {})[line.step] = (value, stderr)
        elif line.metric == "chance":
            chance[line.task] = _in_band(line.value)
    if not scores:
        return None
    figure, axes = report_figure()
    for task, by_step in sorted(scores.items()):
        steps = sorted(by_step)
        shown = axes.errorbar(
            steps,
            [by_step[s][0] for s in steps],
            yerr=[by_step[s][1] for s in steps],
            marker="o",
            markersize=3,
            capsize=2,
            label=plain_label(task),
        )
        if task in chance:
            colour = shown.lines[0].get_color()
            axes.axhline(chance[task], color=colour, linestyle="--", linewidth=1)
    axes.set_ylim(0, 1)
    axes.set_xlabel("step")
    axes.set_ylabel("accuracy (dashed: chance)")
    axes.legend(fontsize="small")
    return png_bytes(figure)


def mixture_plot(run: RunFiles, acc: Accounting) -> bytes | None:
    """The blend's share of each corpus: target weight beside what it achieved."""
    if not run.mixture:
        return None
    figure, axes = report_figure()
    places = range(len(run.mixture))
    width = 0.4
    targets = [float(row["target"]) for row in run.mixture]
    achieved = [float(row["achieved"]) for row in run.mixture]
    axes.bar([x - width / 2 for x in places], targets, width, color="#c7c7c7", label="target")
    axes.bar([x + width / 2 for x in places], achieved, width, color="tab:blue", label="achieved")
    axes.set_xticks(list(places), [plain_label(str(row["corpus"])) for row in run.mixture])
    axes.set_ylabel("share of tokens")
    axes.legend(fontsize="small")
    return png_bytes(figure)


def stage_mixture_plot(run: RunFiles, acc: Accounting) -> bytes | None:
    """The data-mix stages' corpora (the first ``STAGES_DRAWN``), a panel a stage
    (``STAGES_PER_ROW`` to a row): target share beside the share achieved over the stage, a
    wrapped corpus's bar hatched."""
    if len(run.stages) < 2:  # a plain run: the blend's mixture figure says it
        return None
    stages = run.stages[:STAGES_DRAWN]
    rows = -(-len(stages) // STAGES_PER_ROW)
    figure = agg_figure(WIDTH_IN, HEIGHT_IN * rows)
    figure.set_layout_engine("constrained")
    panels = list(figure.subplots(rows, STAGES_PER_ROW, sharey=True, squeeze=False).flat)
    width = 0.4
    for index, (stage, axes) in enumerate(zip(stages, panels[: len(stages)], strict=True)):
        places = range(len(stage.corpora))
        targets = [share.target for share in stage.corpora]
        achieved = [share.achieved for share in stage.corpora]
        axes.bar([x - width / 2 for x in places], targets, width, color="#c7c7c7", label="target")
        bars = axes.bar(
            [x + width / 2 for x in places], achieved, width, color="tab:blue", label="achieved"
        )
        for bar, share in zip(bars, stage.corpora, strict=True):
            bar.set_hatch("//" if share.wrapped else "")
        names = [plain_label(share.corpus) for share in stage.corpora]
        axes.set_xticks(list(places), names, rotation=30, fontsize="small")
        axes.set_title(f"stage {index} from step {stage.start_step:,}", fontsize="small")
        axes.grid(alpha=0.3)
    for axes in panels[len(stages) :]:  # the grid's cells past the last stage
        axes.set_visible(False)
    figure.axes[0].set_ylabel("share of the stage's samples")
    figure.axes[0].legend(fontsize="small")
    return png_bytes(figure)


def lr_find_curve_plot(run: RunFiles, acc: Accounting) -> bytes | None:
    """``goodput diagnose lr-find``'s smoothed loss against the LR (log axis), its suggestion
    marked."""
    found = run.lr_find
    if found is None or len(found["lr"]) < 2:
        return None
    suggested = found["suggested_lr"]  # > 0 or None (run_files)
    lrs = found["lr"] + ([suggested] if suggested is not None else [])
    lr_scale, loss_scale = axis_scale(lrs, log_span=1.0), axis_scale(found["loss"])
    figure, axes = report_figure()
    axes.plot(
        lr_scale.drawn(found["lr"]), loss_scale.drawn(found["loss"]), color="tab:blue",
        linewidth=1.5, label="smoothed loss",
    )  # fmt: skip
    if suggested is not None:
        label = f"suggested lr {suggested:.3g}"
        axes.axvline(*lr_scale.drawn([suggested]), color="black", linestyle="--", label=label)
    if lr_scale.log:  # the LRs of a range test span decades
        axes.set_xscale("log")
    axes.set_xlabel(lr_scale.label("learning rate"))
    axes.set_ylabel(loss_scale.label("loss"))
    axes.legend(fontsize="small")
    return png_bytes(figure)


@dataclass(frozen=True, slots=True)
class SlowRank:
    """A rank on a host that some windows of ``busy.jsonl`` name among their slowest: the
    (window's step, the rank's mean busy time a step) of each, by step."""

    host: str
    rank: int
    points: list[tuple[int, float]]

    @property
    def label(self) -> str:
        windows = f"{len(self.points):,} window{'s' if len(self.points) != 1 else ''}"
        return f"{plain_label(self.host)} rank {self.rank} ({windows})"


def busy_windows(run: RunFiles) -> list[BusyLine]:
    """``busy.jsonl``'s windows by step, each step's last (a window run again after a failure
    replaces the lost one, as a recomputed step does)."""
    return sorted({window.step: window for window in run.busy}.values(), key=lambda w: w.step)


def slowest_ranks(windows: list[BusyLine]) -> list[SlowRank]:
    """Every (host, rank) the windows name among their slowest, the most often named first
    (then the slowest at its worst): a host replaced between attempts is another machine."""
    points: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for window in windows:
        for row in window.slowest:
            points.setdefault((row.host, row.rank), []).append((window.step, row.mean_s))
    ranks = [SlowRank(host, rank, found) for (host, rank), found in points.items()]
    return sorted(ranks, key=lambda r: (-len(r.points), -max(s for _, s in r.points), r.rank))


def busy_figure(run: RunFiles) -> Figure | None:
    """Busy time over the straggler watch's windows (``busy.jsonl``): over ranks, a light band
    from the least to the most, a darker one from the 25th to the 75th percentile, the median
    as a line; the ``BUSY_RANKS`` ranks named slowest most often as points of their own colour,
    the other ranks a window named as grey dots. Each series is decimated (``figures.extremes``,
    ``figures.envelope``): at 5,000 windows and 127,488 ranks the figure holds a few thousand
    points a series, and a rank named in a few windows is those few points."""
    windows = busy_windows(run)
    if not windows:
        return None
    steps = [window.step for window in windows]
    scale = axis_scale([value for window in windows for value in window.quantiles])
    low, p25, median, p75, high = (
        scale.drawn(column) for column in zip(*(w.quantiles for w in windows), strict=True)
    )
    figure, axes = report_figure()
    axes.fill_between(*envelope(steps, low, high), color="#d9d9d9", alpha=0.7, linewidth=0,
                      label="ranks: least to most")  # fmt: skip
    axes.fill_between(*envelope(steps, p25, p75), color="#969696", alpha=0.7, linewidth=0,
                      label="ranks: middle half")  # fmt: skip
    axes.plot(*extremes(steps, median), color="#333333", linewidth=1, label="median rank")
    ranks = slowest_ranks(windows)
    others = sorted(point for rank in ranks[BUSY_RANKS:] for point in rank.points)
    if others:
        xs, ys = extremes([s for s, _ in others], scale.drawn(m for _, m in others))
        axes.scatter(xs, ys, s=3, color="#7f7f7f", linewidths=0,
                     label=f"other ranks among a window's {SLOWEST} slowest")  # fmt: skip
    for rank in ranks[:BUSY_RANKS]:
        xs, ys = extremes([s for s, _ in rank.points], scale.drawn(m for _, m in rank.points))
        axes.scatter(xs, ys, s=9, zorder=3, label=rank.label)
    axes.set_xlabel("step (end of each window)")
    axes.set_ylabel(scale.label("busy time a step (s)"))
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return figure


def busy_plot(run: RunFiles, acc: Accounting) -> bytes | None:
    figure = busy_figure(run)
    return None if figure is None else png_bytes(figure)


def timeline_plot(run: RunFiles, acc: Accounting) -> bytes | None:
    """Attempts as bars over wall-clock hours, coloured by class; a cross where a failed one
    ended; below, a tick at the time of each complete checkpoint's step."""
    if not acc.attempts:
        return None
    figure, axes = report_figure()

    def hours(instant: float) -> float:
        return (instant - acc.start) / 3600

    by_class: dict[str, list[tuple[float, float]]] = {}
    for attempt in acc.attempts:
        span = (hours(attempt.started), hours(attempt.ended) - hours(attempt.started))
        by_class.setdefault(attempt.class_, []).append(span)
    for class_, spans in by_class.items():
        colour = CLASS_COLOURS.get(class_, "#7f7f7f")
        axes.broken_barh(spans, (0.6, 0.8), facecolors=colour, label=class_)
    failures = [hours(a.ended) for a in acc.attempts if a.class_ in FAILED_CLASSES]
    if failures:
        axes.scatter(failures, [1.0] * len(failures), marker="x", s=60, color="black", zorder=3)
        axes.scatter([], [], marker="x", color="black", label="failure")
    saved = checkpoint_times(run, acc)
    if saved:
        axes.scatter([hours(t) for t in saved], [0.0] * len(saved), marker="|", s=200)
        axes.scatter([], [], marker="|", color="tab:blue", label="checkpoint")
    axes.set_yticks([0, 1], ["checkpoints", "attempts"])
    axes.set_ylim(-0.6, 1.8)
    axes.set_xlabel("hours since the run started")
    axes.legend(fontsize="small", ncols=5, loc="upper center", frameon=False)
    return png_bytes(figure)


def checkpoint_times(run: RunFiles, acc: Accounting) -> list[float]:
    """When each complete checkpoint's step ended (its last run), for those the account placed
    on its timeline (a step it left out has no time to trust)."""
    placed = sorted((step for span in acc.timeline for step in span.steps), key=lambda s: s.line)
    ended = {step.step: step.time for step in placed}  # the last run of each step
    return [ended[step] for step in run.checkpoint_steps if step in ended]


def badput_plot(run: RunFiles, acc: Accounting) -> bytes | None:
    """The wall time as one stacked bar: productive, then each cause of badput, in percent."""
    if acc.wall_s <= 0:
        return None
    parts = {"productive": acc.productive_s, **acc.badput_s}
    figure, axes = report_figure(height_in=2.2)
    left = 0.0
    for cause, seconds in parts.items():
        share = 100 * seconds / acc.wall_s
        if share <= 0:
            continue
        colour = CAUSE_COLOURS.get(cause, "#7f7f7f")
        axes.barh(0, share, left=left, color=colour, label=f"{cause} {share:.1f}%")
        left += share
    axes.set_xlim(0, max(100.0, left))
    axes.set_yticks([])
    axes.set_xlabel("% of wall time")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return png_bytes(figure)


PLOTS = (
    Plot(
        "loss",
        "Loss",
        "Training loss of each step's kept run (grey: the lost first runs of steps recomputed "
        "after a failure) and the held-out loss per corpus.",
        loss_plot,
    ),
    Plot("grad-norm", "Gradient norm", "Gradient norm before clipping, per step.", grad_norm_plot),
    Plot("lr", "Learning rate", "The schedule's learning rate, per step.", lr_plot),
    Plot(
        "throughput",
        "Throughput",
        "Tokens per second (left) and model FLOPs utilisation (right), per step.",
        throughput_plot,
    ),
    Plot(
        "accuracy",
        "Eval accuracy",
        "Accuracy of each multiple-choice task with its standard error; dashed: its chance line.",
        accuracy_plot,
    ),
    Plot(
        "mixture",
        "Data mixture",
        "Each corpus's share of the blend's tokens: the target weight and what the blend achieved.",
        mixture_plot,
    ),
    Plot(
        "stages",
        "Data-mix stages",
        "Each data-mix stage's corpora: the target share of the stage's samples and the share "
        "achieved over the stage (hatched: the corpus ran out and wrapped within the stage).",
        stage_mixture_plot,
    ),
    Plot(
        "lr-find",
        "LR finder",
        "The LR range test's smoothed loss against the learning rate; dashed: the suggested LR.",
        lr_find_curve_plot,
    ),
    Plot(
        "busy",
        "Busy time per rank",
        "Each rank's mean busy time a step (the step's time less its waits for the other "
        "ranks) over each straggler-watch window: the ranks' median in a band from their 25th "
        "to 75th percentile, within a lighter one from the least to the most; dots: the "
        f"ranks a window names among its {SLOWEST} slowest, the {BUSY_RANKS} named most often "
        "in colour with their host and how many windows named them.",
        busy_plot,
    ),
    Plot(
        "timeline",
        "Goodput timeline",
        "Every attempt over wall-clock time, coloured by how it ended; crosses: failures; "
        "ticks: complete checkpoints (when their step ended).",
        timeline_plot,
    ),
    Plot(
        "badput",
        "Where the wall time went",
        "Productive, preserved step time and each cause of badput, as shares of the wall time.",
        badput_plot,
    ),
)


def report_figure(height_in: float = HEIGHT_IN) -> tuple[Figure, Axes]:
    figure = agg_figure(WIDTH_IN, height_in)
    figure.set_layout_engine("constrained")  # labels and outside legends stay on the canvas
    axes = figure.subplots()
    axes.grid(alpha=0.3)
    return figure, axes


def _series(steps: list[Step], key: str) -> tuple[list[int], list[float]]:
    points = [(step.step, value) for step in steps if (value := step.values.get(key)) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _step_series_plot(run: RunFiles, key: str, label: str, colour: str) -> bytes | None:
    """One value of the step records over the kept steps, on a log axis when it spans more
    than ``LOG_SPAN`` (a gradient-norm spike would flatten the rest)."""
    kept, _ = kept_and_lost(run.steps)
    steps, values = _series(kept, key)
    if not steps:
        return None
    scale = axis_scale(values, log_span=LOG_SPAN)
    figure, axes = report_figure()
    axes.plot(*extremes(steps, scale.drawn(values)), color=colour, linewidth=1)
    if scale.log:
        axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel(scale.label(label))
    return png_bytes(figure)


def _in_band(value: float) -> float:
    low, high = ACCURACY_BAND
    return min(max(value, low), high)


def plain_label(name: str) -> str:
    """An outside name as a label matplotlib draws as it is: ``$`` escaped (no math), a
    leading ``_`` kept visible (matplotlib hides such legend labels), long ones cut."""
    shown = name if len(name) <= MAX_LABEL else name[: MAX_LABEL - 1] + "…"
    shown = shown.replace("$", r"\$")
    return " " + shown if shown.startswith("_") else shown
