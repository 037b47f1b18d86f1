"""PNG plots of ``goodput diagnose``, drawn with matplotlib's Agg backend (no display needed) and
written atomically. ``lr_find_plot``: the LR range test's loss against lr on a log axis (raw
faint, smoothed bold), its regions shaded and labelled, the suggested LR as a vertical line.

Reads only the finished result; figures come from ``goodput.figures`` (importing this module
imports neither matplotlib nor torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from goodput.figures import agg_figure, png_bytes
from goodput.io import write_bytes

if TYPE_CHECKING:
    from goodput.diagnose.lr_find import LrFindResult

REGION_COLOURS = {"plateau": "tab:gray", "basin": "tab:green", "cliff": "tab:red"}


def lr_find_plot(result: LrFindResult, path: Path) -> None:
    """Draw ``result`` into the PNG file ``path`` (temp file + rename)."""
    figure = agg_figure(8, 5)
    axes = figure.subplots()
    raw = [(p.lr, p.loss) for p in result.curve if p.loss is not None]
    smoothed = [(p.lr, p.smoothed_loss) for p in result.curve if p.smoothed_loss is not None]
    if raw:
        axes.plot(*zip(*raw, strict=True), color="tab:blue", alpha=0.3, linewidth=1, label="loss")
    if smoothed:
        axes.plot(
            *zip(*smoothed, strict=True), color="tab:blue", linewidth=2.5, label="smoothed loss"
        )
    for name, interval in result.regions.as_json().items():
        if interval is not None:
            axes.axvspan(*interval, color=REGION_COLOURS[name], alpha=0.12)
            middle = (interval[0] * interval[1]) ** 0.5  # the middle on a log axis
            axes.text(
                middle, 0.97, name, transform=axes.get_xaxis_transform(), ha="center", va="top"
            )
    suggested = result.regions.suggested_lr
    axes.axvline(suggested, color="black", linestyle="--", label=f"suggested lr {suggested:.3g}")
    if smoothed:
        # The raw loss past the cliff runs off to 10-100x; the smoothed curve sets the scale.
        values = [value for _, value in smoothed]
        low, high = min(values), max(values)
        margin = 0.1 * (high - low) or 0.1 * abs(high) or 1.0
        axes.set_ylim(low - margin, high + 3 * margin)
    axes.set_xscale("log")
    axes.set_xlabel("learning rate")
    axes.set_ylabel("loss")
    axes.set_title(f"LR range test: {len(result.curve)} steps")
    axes.legend(loc="lower left")
    write_bytes(path, png_bytes(figure))
