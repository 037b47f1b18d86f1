"""The run report as one self-contained HTML page: ``write_html`` (``RunFiles`` and their
``Accounting`` -> one file, written atomically), ``render_html`` (the same page as a string).

The page needs nothing beside itself: the CSS is inline, the figures (``plots.PLOTS``) are
PNGs in ``data:`` URIs, there is no script and no link out, so it opens offline, mailed or
copied off a cluster. Its head holds ``outputs.HTML_GENERATOR``: what lets ``--html`` replace
a page of ours and nothing else. Every string that comes from the run (its directory, job ids,
evidence lines, hosts, task and corpus names) is outside input and goes through
``html.escape``: an evidence line that holds markup shows as that text. A figure the run has no
data for is left out and named under the figures.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from goodput.io import write_text
from goodput.outputs import HTML_GENERATOR
from goodput.progress import Progress
from goodput.report.accounting import Accounting, AttemptSummary
from goodput.report.plots import CAUSE_COLOURS, CLASS_COLOURS, PLOTS
from goodput.report.run_files import RunFiles

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.meta { color: #555; } .big { font-size: 1.3em; font-weight: 600; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border-bottom: 1px solid #ddd; padding: 0.2em 0.7em; text-align: left;
  vertical-align: top; white-space: nowrap; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
td.evidence { font-family: ui-monospace, monospace; font-size: 0.9em; max-width: 28em;
  overflow-wrap: anywhere; white-space: normal; }
.swatch { display: inline-block; width: 0.8em; height: 0.8em; margin-right: 0.4em;
  border-radius: 2px; vertical-align: baseline; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; height: auto; }
figcaption { color: #555; font-size: 0.92em; }
"""


def write_html(run: RunFiles, acc: Accounting, out: Path) -> None:
    """Write the report page of ``run`` to ``out`` (temp file + rename)."""
    write_text(out, render_html(run, acc))


def render_html(run: RunFiles, acc: Accounting) -> str:
    title = f"goodput report: {run.run_dir.name or run.run_dir}"
    body = [
        _header(run, acc),
        "<h2>Where the time went</h2>",
        _summary(acc),
        "<h2>Attempts</h2>",
        _attempts(acc),
        "<h2>Step time</h2>",
        _step_time(acc),
        *(["<h2>Data-mix stages</h2>", _stages(run)] if len(run.stages) > 1 else []),
        "<h2>Figures</h2>",
        _figures(run, acc),
    ]
    return (
        "<!DOCTYPE html>\n<html lang='en'>\n<head>\n<meta charset='utf-8'>\n"
        f"{HTML_GENERATOR}\n"
        f"<title>{html_text(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def _header(run: RunFiles, acc: Accounting) -> str:
    state = "done" if run.done else "not done"
    last = "no step yet" if acc.last_step is None else f"last step {acc.last_step:,}"
    span = f"{_utc(acc.start)} to {_utc(acc.end)}" if acc.wall_s > 0 else "no wall time yet"
    return (
        f"<h1>Run {html_text(str(run.run_dir))}</h1>\n"
        f"<p class='meta'>{state} · {last} · {len(acc.attempts)} attempt(s) · {span}</p>\n"
        f"<p><span class='big'>goodput {100 * acc.goodput:.1f}%</span> of "
        f"{_duration(acc.wall_s)} wall time · tokens {100 * acc.token_goodput:.1f}% "
        f"({acc.tokens_kept:,} kept) · {acc.steps_kept:,} steps kept, "
        f"{acc.steps_recomputed:,} recomputed</p>"
        + "".join(f"\n<p class='meta'>{html_text(note)}</p>" for note in acc.ignored_notes())
    )


def _summary(acc: Accounting) -> str:
    wall = acc.wall_s or float("inf")
    rows = [("productive", acc.productive_s), *acc.badput_s.items()]
    return html_table(
        ["", "seconds", "% of wall"],
        (
            [
                _swatch(CAUSE_COLOURS.get(cause, "#7f7f7f")) + html_text(cause),
                f"{seconds:,.1f}",
                f"{100 * seconds / wall:.1f}",
            ]
            for cause, seconds in rows
        ),
        classes=dict.fromkeys((1, 2), "n"),
    )


def _attempts(acc: Accounting) -> str:
    if not acc.attempts:
        return "<p>No attempts recorded.</p>"
    header = ["#", "job", "class", "exit", "started (h)", "length", "from", "steps", "gained"]
    header += ["evidence", "hosts evicted", "recovery"]
    return html_table(
        header,
        (_attempt_row(a, acc.start) for a in acc.attempts),
        classes={**dict.fromkeys((0, 3, 4, 5, 8, 11), "n"), 9: "evidence"},
    )


def _attempt_row(attempt: AttemptSummary, start: float) -> list[str]:
    steps = "-" if attempt.first_step is None else f"{attempt.first_step:,}–{attempt.last_step:,}"
    colour = CLASS_COLOURS.get(attempt.class_, "#7f7f7f")
    recovery = "-" if attempt.recovery_s is None else _duration(attempt.recovery_s)
    return [
        str(attempt.attempt),
        html_text(attempt.job or "-"),
        _swatch(colour) + html_text(attempt.class_),
        "-" if attempt.exit_code is None else str(attempt.exit_code),
        f"{(attempt.started - start) / 3600:.2f}",
        _duration(attempt.ended - attempt.started),
        html_text(attempt.loaded_from()),
        steps,
        f"{attempt.steps_gained:,}",
        html_text(attempt.evidence or ""),
        html_text(", ".join(attempt.hosts_evicted)),
        recovery,
    ]


def _step_time(acc: Accounting) -> str:
    names = ("median", "p90", "p99", "max")
    cells = [f"{float(acc.step_time.get(key, 0.0)):.3f} s" for key in names]
    slow = int(acc.step_time.get("slow_steps", 0))
    header = [*names, "slow steps"]
    return html_table(header, [[*cells, f"{slow:,}"]], classes=dict.fromkeys(range(5), "n"))


def _stages(run: RunFiles) -> str:
    """Each data-mix stage's corpora: target and achieved share (the figure draws them)."""
    header = ["stage", "from step", "file list", "corpus", "target %", "achieved %", "wrapped"]
    rows = [
        [
            str(index), f"{stage.start_step:,}", html_text(stage.file_list),
            html_text(share.corpus), f"{100 * share.target:.2f}",
            f"{100 * share.achieved:.2f}", "yes" if share.wrapped else "",
        ]
        for index, stage in enumerate(run.stages)
        for share in stage.corpora
    ]  # fmt: skip
    return html_table(header, rows, classes=dict.fromkeys((0, 1, 4, 5), "n"))


def _figures(run: RunFiles, acc: Accounting) -> str:
    shown, absent = [], []
    with Progress("report", total=len(PLOTS), unit="figures") as progress:
        drawn = []
        for plot in PLOTS:
            drawn.append(plot.draw(run, acc))
            progress.advance(1)
    for plot, png in zip(PLOTS, drawn, strict=True):
        if png is None:
            absent.append(plot.title)
            continue
        data = base64.b64encode(png).decode("ascii")
        shown.append(
            f"<figure id='{plot.name}'>\n<img alt='{html_text(plot.title)}' "
            f"src='data:image/png;base64,{data}'>\n"
            f"<figcaption><b>{html_text(plot.title)}.</b> {html_text(plot.caption)}</figcaption>\n"
            "</figure>"
        )
    if absent:
        shown.append(f"<p class='meta'>No data for: {html_text(', '.join(absent))}.</p>")
    return "\n".join(shown)


def html_table(header: list[str], rows: Iterable[list[str]], classes: dict[int, str]) -> str:
    """A table of cells that are already HTML (each built with ``_text``); ``classes``: the
    CSS class of a column's cells."""

    def cell(tag: str, index: int, content: str) -> str:
        kind = f" class='{classes[index]}'" if index in classes else ""
        return f"<{tag}{kind}>{content}</{tag}>"

    head = "".join(cell("th", i, html_text(name)) for i, name in enumerate(header))
    body = ["<tr>" + "".join(cell("td", i, c) for i, c in enumerate(row)) + "</tr>" for row in rows]
    return "<table>\n<tr>" + head + "</tr>\n" + "\n".join(body) + "\n</table>"


def _swatch(colour: str) -> str:
    return f"<span class='swatch' style='background:{html_text(colour)}'></span>"


def html_text(value: str) -> str:
    return html.escape(value, quote=True)


def _utc(instant: float) -> str:
    return datetime.fromtimestamp(instant, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float) -> str:
    """``1h 02m 03s`` / ``2m 03s`` / ``4.2s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"
