"""How any goodput plot gets its figure and its PNG: matplotlib's Agg canvas (no display, no
pyplot state, the same pixels everywhere) and PNG bytes signed as goodput's; and how an axis
draws numbers of any finite size (``axis_scale``).

matplotlib computes an axis's span, margins, ticks and log decades in floats: from about 1e300
on they overflow (``ValueError: arange: cannot compute length``, an ``OverflowError``, a
singular transform). An axis whose numbers reach past ``MAX_DRAWN`` draws them divided by a
power of ten that its label names (``loss (x 1e308)``); a log axis is used only where its
numbers span at most ``MAX_LOG_DECADES``, so that after that division they stay far from float's
smallest too. A figure draws every number its file admits.

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
