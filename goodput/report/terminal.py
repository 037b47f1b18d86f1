"""The terminal view of a run's accounting: a compact summary as ``rich`` tables (goodput, the
badput causes that cost anything, step time, attempts: each with where its process loaded its
state from; a run of data-mix stages, each stage's target and achieved mixture), the same on a
terminal or in a log (no colour there)."""

from __future__ import annotations

from datetime import UTC, datetime

from rich.console import Group
from rich.table import Table
from rich.text import Text

from goodput.report.accounting import Accounting
from goodput.report.run_files import RunFiles
from goodput.runfiles import StageMixture

MAX_ATTEMPT_ROWS = 20  # the last ones; --json has them all


def summary(run: RunFiles, acc: Accounting) -> Group:
    state = "done" if acc.done else "not done"
    title = Text.assemble(
        (f"{run.run_dir}", "bold"),
        f": goodput {acc.goodput:.1%} of {_duration(acc.wall_s)} wall ({state}; step "
        f"{acc.last_step if acc.last_step is not None else '-'}, {acc.steps_recomputed} "
        f"step(s) recomputed; tokens goodput {acc.token_goodput:.1%})",
    )
    notes = [Text(note, style="yellow") for note in acc.ignored_notes()]  # Text: never markup
    tables = [_time_table(acc), _step_table(acc), _attempt_table(acc)]
    if len(run.stages) > 1:  # a plain run's one mixture is the blend's report
        tables.append(stage_table(run.stages))
    return Group(title, *notes, *tables)


def stage_table(stages: list[StageMixture]) -> Table:
    """Each data-mix stage's corpora: target and achieved share of the stage's samples."""
    table = Table(title="data-mix stages", title_justify="left")
    for column in ("stage", "from step", "corpus", "target %", "achieved %", ""):
        table.add_column(column, justify="right" if "%" in column else "left")
    for index, stage in enumerate(stages):
        for row, share in enumerate(stage.corpora):
            table.add_row(
                str(index) if row == 0 else "",
                f"{stage.start_step:,}" if row == 0 else "",
                Text(share.corpus),  # Text: outside input, never markup
                f"{100 * share.target:.2f}",
                f"{100 * share.achieved:.2f}",
                "wrapped" if share.wrapped else "",
            )
    return table


def _time_table(acc: Accounting) -> Table:
    table = Table(title="where the wall time went", title_justify="left")
    for column in ("", "seconds", "% of wall"):
        table.add_column(column, justify="right" if column else "left")
    wall = acc.wall_s or float("inf")
    table.add_row("productive", f"{acc.productive_s:,.1f}", f"{100 * acc.productive_s / wall:.1f}")
    for cause, seconds in sorted(acc.badput_s.items(), key=lambda item: -item[1]):
        if seconds > 0:
            table.add_row(cause.replace("_", " "), f"{seconds:,.1f}", f"{100 * seconds / wall:.1f}")
    return table


def _step_table(acc: Accounting) -> Table:
    table = Table(title="step time (kept steps)", title_justify="left")
    for column in ("median", "p90", "p99", "max", "slow (> 1.5x median)"):
        table.add_column(column, justify="right")
    times = acc.step_time
    table.add_row(
        *(f"{float(times[key]):.3f} s" for key in ("median", "p90", "p99", "max")),
        f"{int(times['slow_steps']):,} of {acc.steps_kept:,}",
    )
    return table


def _attempt_table(acc: Accounting) -> Table:
    shown = acc.attempts[-MAX_ATTEMPT_ROWS:]
    hidden = len(acc.attempts) - len(shown)
    title = "attempts" + (f" (the last {len(shown)} of {len(acc.attempts)})" if hidden else "")
    table = Table(title=title, title_justify="left")
    columns = ("#", "job", "started (UTC)", "class", "exit", "from", "steps", "recovery")
    for column in (*columns, "evidence"):
        table.add_column(column)
    for attempt in shown:
        steps = (
            f"{attempt.first_step}-{attempt.last_step}" if attempt.first_step is not None else "-"
        )
        evicted = f" (evicted {', '.join(attempt.hosts_evicted)})" if attempt.hosts_evicted else ""
        table.add_row(
            str(attempt.attempt),
            attempt.job or "-",
            datetime.fromtimestamp(attempt.started, UTC).strftime("%Y-%m-%d %H:%M:%S"),
            attempt.class_,
            "-" if attempt.exit_code is None else str(attempt.exit_code),
            attempt.loaded_from(),
            steps,
            "-" if attempt.recovery_s is None else _duration(attempt.recovery_s),
            Text((attempt.evidence or "") + evicted),  # Text: outside input, never markup
        )
    return table


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
