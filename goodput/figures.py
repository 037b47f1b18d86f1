"""How any goodput plot gets its figure and its PNG: matplotlib's Agg canvas (no display, no
pyplot state, the same pixels everywhere) and PNG bytes signed as goodput's; and how an axis
draws numbers of any finite size (``axis_scale``).

matplotlib computes an axis's span, margins, ticks and log decades in floats: from about 1e300
on they overflow (``ValueError: arange: cannot compute length``, an ``OverflowError``, a
singular transform). An axis whose numbers reach past ``MAX_DRAWN`` draws them divided by a
power of ten that its label names (``loss (x 1e308)``); a log axis is used only where its
numbers span at most ``MAX_LOG_DECADES``, so that after that division they stay far from float's
smallest too. A figure draws every number its file admits.

A long series is decimated before it is drawn (``extremes``, ``envelope``): its points are cut
into at most ``MAX_BUCKETS`` runs of consecutive points, and each run keeps only its extremes
(the lowest and the highest point, in order; a band's least low and greatest high at the run's
first and last x). An axis is about 700 pixels wide, so a line of 100,000 steps drawn whole is
hundreds of points a pixel column: slow to draw, the same picture. Each bucket's extremes keep
every spike and dip a pixel column would show.

matplotlib is imported here and nowhere else, and only when a figure is made: importing this
module imports neither matplotlib nor torch (a report runs on a login node). The run report
(``report.plots``) and ``goodput diagnose`` (``diagnose.plots``) draw through it.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from goodput.outputs import PNG_SOFTWARE

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_DRAWN = 1e100  # matplotlib's arithmetic on an axis is far from overflow below this
MAX_LOG_DECADES = 200  # a log axis of more would, divided by MAX_DRAWN's power, near 1e-300
MAX_BUCKETS = 1000  # runs of points a drawn series is cut into: over an axis's ~700 pixels


def agg_figure(width_in: float, height_in: float, dpi: int = 100) -> Figure:
    """A figure of that size on the Agg canvas: no display, no pyplot state, the same pixels
    everywhere."""
    import matplotlib

    matplotlib.use("Agg")  # before anything draws: never a GUI backend
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), dpi=dpi)


def png_bytes(figure: Figure) -> bytes:
    """``figure`` as one PNG file's bytes, signed as goodput's (``outputs.PNG_SOFTWARE`` in its
    Software text): what lets ``--plot`` replace a plot of ours and nothing else."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": PNG_SOFTWARE})
    return buffer.getvalue()


@dataclass(frozen=True, slots=True)
class AxisScale:
    """How one axis draws its numbers: each divided by ``10 ** exponent`` (its label says so),
    on a log scale or not (see the module docstring)."""

    exponent: int = 0
    log: bool = False

    def drawn(self, values: Iterable[float]) -> list[float]:
        """``values`` as the axis draws them."""
        divisor = 10.0**self.exponent
        return [value / divisor for value in values]

    def label(self, name: str) -> str:
        """``name`` with the power of ten the axis divides by, when it divides."""
        return f"{name} (× 1e{self.exponent})" if self.exponent else name


def axis_scale(values: Sequence[float], *, log_span: float | None = None) -> AxisScale:
    """The scale an axis of finite ``values`` draws them on: divided by the power of ten of the
    largest magnitude when that is past ``MAX_DRAWN``; on a log scale when ``log_span`` is
    given, every value is > 0 and the largest is more than ``log_span`` times the least (at
    most ``MAX_LOG_DECADES`` decades apart)."""
    largest = max((abs(value) for value in values), default=0.0)
    exponent = math.floor(math.log10(largest)) if largest > MAX_DRAWN else 0
    low = min(values, default=0.0)
    log = (
        log_span is not None
        and low > 0
        and largest / low > log_span
        and math.log10(largest) - math.log10(low) <= MAX_LOG_DECADES
    )
    return AxisScale(exponent, log)


def buckets(count: int) -> list[range]:
    """``range(count)`` cut into at most ``MAX_BUCKETS`` runs of consecutive indices, in order."""
    parts = min(count, MAX_BUCKETS)
    return [range(count * i // parts, count * (i + 1) // parts) for i in range(parts)]


def extremes(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    """The points of (``xs``, ``ys``) that a drawn line keeps: each bucket's lowest and highest
    (once when they are one point), in order; at most ``2 * MAX_BUCKETS``, all of them when
    there are no more than ``MAX_BUCKETS``."""
    if len(xs) <= MAX_BUCKETS:
        return list(xs), list(ys)
    kept: list[int] = []
    for part in buckets(len(xs)):
        low = min(part, key=ys.__getitem__)
        high = max(part, key=ys.__getitem__)
        kept.extend((low, high) if low < high else (high, low) if high < low else (low,))
    return [xs[i] for i in kept], [ys[i] for i in kept]


def envelope(
    xs: Sequence[float], lows: Sequence[float], highs: Sequence[float]
) -> tuple[list[float], list[float], list[float]]:
    """The band between ``lows`` and ``highs`` over ``xs`` as it is drawn: each bucket's least
    low and greatest high, at its first and its last x; all of it when there are no more than
    ``MAX_BUCKETS`` points."""
    if len(xs) <= MAX_BUCKETS:
        return list(xs), list(lows), list(highs)
    drawn_x: list[float] = []
    drawn_low: list[float] = []
    drawn_high: list[float] = []
    for part in buckets(len(xs)):
        low, high = min(lows[part.start : part.stop]), max(highs[part.start : part.stop])
        drawn_x.extend((xs[part[0]], xs[part[-1]]))
        drawn_low.extend((low, low))
        drawn_high.extend((high, high))
    return drawn_x, drawn_low, drawn_high
