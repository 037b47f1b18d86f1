"""How any goodput plot gets its figure and its PNG: matplotlib's Agg canvas (no display, no
pyplot state, the same pixels everywhere) and PNG bytes signed as goodput's.

matplotlib is imported here and nowhere else, and only when a figure is made: importing this
module imports neither matplotlib nor torch (a report runs on a login node). The run report
(``report.plots``) and ``goodput diagnose`` (``diagnose.plots``) draw through it.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from goodput.outputs import PNG_SOFTWARE

if TYPE_CHECKING:
    from matplotlib.figure import Figure


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
