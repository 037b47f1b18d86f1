"""The views of a ``Comparison`` (runs at matched tokens, ``compare.py``): ``comparison_json``
(every series and every reach, for ``--json``), ``comparison_summary`` (``rich`` tables for the
terminal) and ``render_comparison_html`` / ``write_comparison_html`` (one page, ``--html``).

The page keeps the run report's conventions (``html.py``): self-contained, inline CSS, figures
as PNGs in ``data:`` URIs, no script, ``outputs.HTML_GENERATOR`` in its head, every string from
the runs (their paths, corpus and task names) escaped. It draws one figure per series, every run
overlaid in its own colour and named in the legend; the training loss shows the raw points
faint under the smoothed line, and each data-mix stage's start is a dotted line in its run's
colour. Figures are drawn as the run report's are (``plots``' canvas, names as plain text).
Imported from ``html`` and ``plots``: their table, escaping, canvas and label helpers, so that
both pages read alike. Nothing here reads a run.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from goodput import rundir
from goodput.figures import axis_scale, png_bytes
from goodput.io import write_text
from goodput.outputs import HTML_GENERATOR
from goodput.report.compare import LOSS, ComparedRun, Comparison, Reach
from goodput.report.html import STYLE, html_table, html_text
from goodput.report.plots import plain_label, report_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REACH_HEADER = ["series", "run", "reaches the final of", "value", "at tokens", "which took", ""]


def comparison_json(comparison: Comparison) -> dict[str, Any]:
    return {
        "smoothing_tokens": comparison.smoothing_tokens,
        "runs": [_run_json(run) for run in comparison.runs],
        "reaches": [
            {
                "series": reach.series,
                "run": reach.run,
                "target_run": reach.target_run,
                "target": reach.target,
                "tokens": reach.tokens,
                "target_tokens": reach.target_tokens,
                "ratio": reach.ratio,
            }
            for reach in comparison.reaches
        ],
    }


def _run_json(run: ComparedRun) -> dict[str, Any]:
    series: dict[str, Any] = {}
    for name, found in run.series.items():
        entry: dict[str, Any] = {
            "higher_is_better": found.higher_is_better,
            "tokens": [tokens for tokens, _ in found.points],
            "value": [value for _, value in found.points],
        }
        if found.raw is not None:
            entry["raw"] = [value for _, value in found.raw]
        series[name] = entry
    return {
        "label": run.label,
        "run_dir": str(run.run_dir),
        "tokens_derived": run.tokens_derived,
        "evals_left_out": run.evals_left_out,
        "stage_starts": list(run.stage_starts),
        "series": series,
    }


# --- terminal -------------------------------------------------------------------------------


def comparison_summary(comparison: Comparison) -> Group:
    runs = Table(title="runs at matched tokens", title_justify="left")
    for column in ("run", "tokens seen", "final loss (smoothed)", "tokens from"):
        runs.add_column(column, justify="left" if column == "run" else "right")
    for run in comparison.runs:
        tokens, loss = run.series[LOSS].final
        source = "step x tokens_per_step" if run.tokens_derived else "metrics"
        runs.add_row(Text(run.label), tokens_text(tokens), f"{loss:.4g}", source)
    note = f"training loss: trailing mean over {tokens_text(comparison.smoothing_tokens)} tokens"
    lines = [Text(note), *(Text(line, "yellow") for line in left_out_notes(comparison))]
    lines.append(Text("where each run first reaches another's final value:", "bold"))
    lines += [Text(reach_sentence(reach)) for reach in comparison.reaches]  # Text: never markup
    return Group(runs, *lines)


def left_out_notes(comparison: Comparison) -> list[str]:
    """A line for each run with evals that nothing placed on the tokens axis."""
    return [
        f"{run.label}: {run.evals_left_out} eval point(s) left out: at steps with no metrics "
        f"line, and no {rundir.CONFIG} to place them"
        for run in comparison.runs
        if run.evals_left_out
    ]


def reach_sentence(reach: Reach) -> str:
    """``A reaches B's final loss 2.31 at 1.2M tokens, B took 3M: 2.5x fewer tokens``."""
    head = f"{reach.run} reaches {reach.target_run}'s final {reach.series} {reach.target:.4g}"
    took = f"{reach.target_run} took {tokens_text(reach.target_tokens)}"
    if reach.tokens is None:
        return f"{head}: never ({took})"
    return f"{head} at {tokens_text(reach.tokens)} tokens, {took}: {_verdict(reach.ratio)}"


def reach_cells(reach: Reach) -> list[str]:
    """The reach's row: series, run, target run, value, where, where the target got there, how
    many times fewer tokens."""
    at = "never" if reach.tokens is None else tokens_text(reach.tokens)
    return [
        reach.series,
        reach.run,
        reach.target_run,
        f"{reach.target:.4g}",
        at,
        tokens_text(reach.target_tokens),
        _verdict(reach.ratio),
    ]


def _verdict(ratio: float | None) -> str:
    if ratio is None:
        return "-"
    if round(ratio, 2) == 1:
        return "as many tokens"
    if ratio >= 1:
        return f"{ratio:.3g}x fewer tokens"
    return f"{1 / ratio:.3g}x more tokens"


def tokens_text(tokens: int) -> str:
    """``950``, ``1.2K``, ``3M``, ``7.77T``, ``9.01e+15``: three significant digits."""
    if tokens >= 1e15:  # up to 2**62 (runfiles.MAX_COUNT): "4.61e+18", not "4.61e+06T"
        return f"{tokens:.3g}"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if tokens >= scale:
            return f"{tokens / scale:.3g}{suffix}"
    return str(tokens)


# --- the page -------------------------------------------------------------------------------


def write_comparison_html(comparison: Comparison, out: Path) -> None:
    """Write the comparison's page to ``out`` (temp file + rename)."""
    write_text(out, render_comparison_html(comparison))


def render_comparison_html(comparison: Comparison) -> str:
    names = ", ".join(run.label for run in comparison.runs)
    body = [
        f"<h1>Runs at matched tokens: {html_text(names)}</h1>",
        f"<p class='meta'>Training loss: trailing mean over "
        f"{tokens_text(comparison.smoothing_tokens)} tokens (1/50 of the shortest run).</p>",
        *(f"<p class='meta'>{html_text(line)}</p>" for line in left_out_notes(comparison)),
        _runs_table(comparison),
        "<h2>Where each run first reaches another's final value</h2>",
        html_table(
            REACH_HEADER,
            ([html_text(cell) for cell in reach_cells(r)] for r in comparison.reaches),
            classes=dict.fromkeys((3, 4, 5), "n"),
        ),
        "<h2>Figures</h2>",
        *(
            _figure_html(comparison, name, index)
            for index, name in enumerate(comparison.series_names())
        ),
    ]
    return (
        "<!DOCTYPE html>\n<html lang='en'>\n<head>\n<meta charset='utf-8'>\n"
        f"{HTML_GENERATOR}\n"
        f"<title>goodput report: {html_text(names)}</title>\n<style>{STYLE}</style>\n</head>\n"
        "<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )


def _runs_table(comparison: Comparison) -> str:
    rows = []
    for run in comparison.runs:
        tokens, loss = run.series[LOSS].final
        source = "step × tokens_per_step" if run.tokens_derived else "metrics"
        cells = [str(run.run_dir), tokens_text(tokens), f"{loss:.4g}", source]
        rows.append([html_text(cell) for cell in cells])
    header = ["run", "tokens seen", "final loss (smoothed)", "tokens from"]
    return html_table(header, rows, classes=dict.fromkeys((1, 2), "n"))


def _figure_html(comparison: Comparison, name: str, index: int) -> str:
    png = draw_series(comparison, name)
    data = base64.b64encode(png).decode("ascii")
    what = "higher is better" if _higher_is_better(comparison, name) else "lower is better"
    return (
        f"<figure id='series-{index}'>\n<img alt='{html_text(name)}' "
        f"src='data:image/png;base64,{data}'>\n"
        f"<figcaption><b>{html_text(name)}</b> over tokens seen ({what}).</figcaption>\n</figure>"
    )


def _higher_is_better(comparison: Comparison, name: str) -> bool:
    return any(run.series[name].higher_is_better for run in comparison.runs if name in run.series)


def draw_series(comparison: Comparison, name: str) -> bytes:
    return png_bytes(series_figure(comparison, name))


def series_figure(comparison: Comparison, name: str) -> Figure:
    """One series of every run that has it, overlaid over tokens seen, each run in the legend."""
    having = [(index, run, run.series[name]) for index, run in enumerate(comparison.runs)
              if name in run.series]  # fmt: skip
    scale = axis_scale(
        [value for _, _, series in having for _, value in (*series.points, *(series.raw or ()))]
    )
    figure, axes = report_figure()
    for index, run, series in having:
        colour = f"C{index}"
        for start in run.stage_starts:  # where a data-mix stage began
            axes.axvline(start, color=colour, linestyle=":", linewidth=1)
        if series.raw is not None and series.raw != series.points:
            tokens, values = zip(*series.raw, strict=True)
            axes.plot(tokens, scale.drawn(values), color=colour, alpha=0.25, linewidth=0.8)
        marker = None if name == LOSS else "o"  # evals are few points: each shown
        tokens, values = zip(*series.points, strict=True)
        axes.plot(
            tokens,
            scale.drawn(values),
            color=colour,
            marker=marker,
            markersize=3,
            label=plain_label(run.label),
        )
    longest = max(run.series[LOSS].final[0] for run in comparison.runs)
    axes.set_xlim(0, 1.02 * longest)  # one axis on every figure: the evals line up with the loss
    axes.set_xlabel("tokens seen")
    axes.set_ylabel(scale.label(plain_label(name)))
    axes.legend(fontsize="small")
    return figure
