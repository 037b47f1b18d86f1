"""The report's figures: each is a PNG of the agreed size when the run holds its data and None
when it does not; recomputed steps keep their last run; outside names draw as plain text."""

from __future__ import annotations

import struct
import sys
from dataclasses import replace
from pathlib import Path
from typing import get_args

import pytest
from matplotlib.collections import PathCollection

from goodput import figures
from goodput.launch.history import AttemptClass
from goodput.report import plots
from goodput.report.accounting import account
from goodput.report.run_files import RunFiles, Step
from goodput.runfiles import SLOWEST, RankBusy
from goodput.testing.scale_runs import ScaleRun, busy_windows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(png: bytes) -> tuple[int, int]:
    assert png.startswith(PNG_MAGIC)
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk comes first
    return width, height


def bare_run(**changes) -> RunFiles:
    run = RunFiles(
        run_dir=Path("/nowhere"),
        steps=[],
        evals=[],
        attempts=[],
        record=None,
        checkpoint_steps=[],
        done=False,
        mixture=None,
        lr_find=None,
    )
    return replace(run, **changes)


@pytest.mark.parametrize("plot", plots.PLOTS, ids=lambda p: p.name)
def test_every_figure_is_a_small_png_of_the_full_run(full_run, plot):
    run, acc = full_run
    png = plot.draw(run, acc)
    assert png is not None
    width, height = png_size(png)
    assert width == 800 and height <= 350
    assert len(png) < 200_000  # the page stays light


@pytest.mark.parametrize("plot", plots.PLOTS, ids=lambda p: p.name)
def test_a_run_without_data_draws_nothing(plot):
    run = bare_run()
    assert plot.draw(run, account(run)) is None


def test_only_the_figures_whose_data_is_there_are_drawn(full_run):
    run, _ = full_run
    steps_only = replace(run, evals=[], attempts=[], mixture=None, lr_find=None, busy=[], stages=[])
    drawn = {p.name for p in plots.PLOTS if p.draw(steps_only, account(steps_only))}
    # Without attempt records the timeline shows the processes the steps tell apart.
    assert drawn == {"loss", "grad-norm", "lr", "throughput", "timeline", "badput"}


def test_the_loss_of_a_recomputed_step_is_its_last_run():
    steps = [
        Step(step=1, time=1.0, step_time_s=1.0, tokens=1, values={"loss": 3.0}),
        Step(step=2, time=2.0, step_time_s=1.0, tokens=1, values={"loss": 9.0}),
        Step(step=2, time=5.0, step_time_s=1.0, tokens=1, values={"loss": 2.5}),
        Step(step=3, time=6.0, step_time_s=1.0, tokens=1, values={"loss": 2.0}),
    ]
    kept, lost = plots.kept_and_lost(steps)
    assert [(s.step, s.values["loss"]) for s in kept] == [(1, 3.0), (2, 2.5), (3, 2.0)]
    assert [(s.step, s.values["loss"]) for s in lost] == [(2, 9.0)]


def test_held_out_losses_come_from_step_records_and_eval_lines(full_run):
    run, _ = full_run
    assert plots.heldout_losses(run) == {
        "code": [(10, 4.5), (20, 4.0)],
        "web": [(10, 5.5), (20, 5.0)],
    }
    record = Step(step=5, time=1.0, step_time_s=1.0, tokens=1, values={"heldout_loss/books": 7.0})
    assert plots.heldout_losses(bare_run(steps=[record])) == {"books": [(5, 7.0)]}
    assert plots.loss_plot(bare_run(steps=[record]), account(bare_run())) is not None


def test_checkpoints_are_marked_when_their_step_last_ended(full_run):
    run, acc = full_run
    last_end = {s.step: s.time for s in run.steps}
    assert plots.checkpoint_times(run, acc) == [last_end[10], last_end[20]]
    # A run the account leaves out (its time past the year 2514) marks no checkpoint.
    beyond = replace(run.steps[-1], time=sys.float_info.max, line=len(run.steps) + 1)
    far = replace(run, steps=[*run.steps, beyond])
    assert plots.checkpoint_times(far, account(far)) == [last_end[10], last_end[20]]
    assert plots.timeline_plot(far, account(far)) is not None


def test_names_from_the_run_are_drawn_as_plain_text():
    # Unescaped, "$\frac$" is math that matplotlib cannot parse: the draw would raise.
    assert plots.plain_label(r"mc $\frac$") == r"mc \$\frac\$"
    assert plots.plain_label("_hidden") == " _hidden"
    assert len(plots.plain_label("x" * 100)) == plots.MAX_LABEL
    run = bare_run(mixture=[{"corpus": r"$\frac$", "target": 1.0, "achieved": 1.0}])
    assert plots.mixture_plot(run, account(run)) is not None


def test_busy_time_is_read_per_window_and_the_slow_rank_leads(full_run):
    run, _ = full_run
    windows = [(window.step, window.ranks, len(window.slowest)) for window in run.busy]
    assert windows == [(5, 20, 5), (10, 20, 5), (15, 20, 5), (20, 20, 5)]
    assert [window.slowest[0].rank for window in run.busy] == [19, 7, 7, 7]
    ranks = plots.slowest_ranks(plots.busy_windows(run))
    # Named in every window, and the slowest of those that were: rank 19.
    assert (ranks[0].rank, len(ranks[0].points)) == (19, 4)
    assert ("nid0003", 7, 3) in [(r.host, r.rank, len(r.points)) for r in ranks]
    # A window run again after a failure replaces the lost one, as a recomputed step does.
    again = replace(run.busy[-1], slowest=run.busy[-1].slowest[:1])
    kept = plots.busy_windows(replace(run, busy=[*run.busy, again]))
    assert [window.step for window in kept] == [5, 10, 15, 20] and kept[-1] is again


def test_the_busy_figure_names_the_ranks_named_most_often_with_their_hosts(full_run):
    run, _ = full_run
    figure = plots.busy_figure(run)
    assert figure is not None
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert labels[:3] == ["ranks: least to most", "ranks: middle half", "median rank"]
    assert "nid0003 rank 7 (3 windows)" in labels
    # The host named in math and markup, as plain text (matplotlib would raise on the math).
    assert (
        plots.plain_label(r"mc $\frac$<script>alert(1)</script>") + " rank 19 (4 windows)" in labels
    )
    assert len(labels) <= 4 + plots.BUSY_RANKS


def test_a_long_run_draws_a_few_thousand_points_a_series_and_a_rare_rank_as_points(tmp_path):
    """5,000 windows over 127,488 ranks (the issue's run): every series is decimated, and a
    rank named in three windows is three points, not a line across the run."""
    shape = ScaleRun(steps=100_000, window=20)
    windows = busy_windows(shape)
    rare = RankBusy(3, "spare0001", 0.0)  # a host of no other window
    marked = {1000, 2000, 3000}
    for index in marked:  # the slowest window-wide's list gains a rank named nowhere else
        window = windows[index]
        slowest = (*window.slowest[: SLOWEST - 1], replace(rare, mean_s=window.quantiles[0]))
        windows[index] = replace(window, slowest=slowest)
    run = replace(bare_run(), busy=windows)
    figure = plots.busy_figure(run)
    assert figure is not None
    axes = figure.axes[0]
    assert max(len(line.get_xydata()) for line in axes.get_lines()) <= 2 * figures.MAX_BUCKETS
    scatters = [c for c in axes.collections if isinstance(c, PathCollection)]
    assert len(scatters) == 1 + plots.BUSY_RANKS
    assert max(len(c.get_offsets()) for c in scatters) <= 2 * figures.MAX_BUCKETS
    bands = [c for c in axes.collections if c not in scatters]
    assert len(bands) == 2  # a band's outline: its two edges, each decimated
    assert max(len(p.vertices) for c in bands for p in c.get_paths()) <= 4 * figures.MAX_BUCKETS + 3
    named = {(r.host, r.rank): len(r.points) for r in plots.slowest_ranks(windows)}
    assert named[("spare0001", 3)] == 3
    top = [r.rank for r in plots.slowest_ranks(windows)[:2]]
    assert top == [shape.steady, shape.flapping]
    png = plots.busy_plot(run, account(run))
    assert png is not None and png_size(png) == (800, 350)


def test_every_attempt_class_and_badput_cause_has_a_colour():
    assert set(plots.CLASS_COLOURS) == {*get_args(AttemptClass), "running", "unrecorded"}
    assert plots.FAILED_CLASSES.issubset(plots.CLASS_COLOURS)
