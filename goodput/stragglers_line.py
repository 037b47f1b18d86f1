"""The straggler line: the one warning the trainer prints when a rank lags, and its parser.

Rank 0 prints it (``train/monitor/stragglers.py``); the launcher's output scanner reads it back into
an attempt's evidence (source ``straggler``), and ``goodput chaos`` checks the rank it names. One
definition of the text for the writer and every reader (one line)::

    warning: straggler: rank 3 on nid0012 busy 1.62x the median over steps 12-31
    (0.231 s vs 0.143 s)

``parse_notice`` is strict and bounded: a line longer than ``MAX_LINE_CHARS`` is not read, and
every field must have the form ``line()`` writes (a host name as ``ranks.HOSTNAME`` allows,
integers of at most 16 digits, first step <= last step). Text before ``warning: straggler:``
(a launcher's ``[rank0]:`` prefix, say) is allowed; text after it is not. It returns the notice
or None, never raises.

Standard library only: ``train`` writes the line, ``launch`` and ``chaos`` read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MARKER = "warning: straggler: "
MAX_LINE_CHARS = 1024  # a notice is at most ~400 characters; anything longer is not one
MAX_STEP = 2**53
NOTICE = re.compile(
    re.escape(MARKER) + r"rank (?P<rank>[0-9]{1,16}) on (?P<host>[A-Za-z0-9][A-Za-z0-9._-]{0,252}) "
    r"busy (?P<ratio>[0-9]{1,16}\.[0-9]{2})x the median over steps "
    r"(?P<first>[0-9]{1,16})-(?P<last>[0-9]{1,16}) "
    r"\((?P<busy>[0-9]{1,16}\.[0-9]{3}) s vs (?P<median>[0-9]{1,16}\.[0-9]{3}) s\)\s*"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerNotice:
    """Rank ``rank`` on ``host`` was busy ``ratio`` times the median over steps
    ``first_step``..``last_step``: ``busy_s`` a step on average, against ``median_s``."""

    rank: int
    host: str
    ratio: float
    first_step: int
    last_step: int
    busy_s: float
    median_s: float

    def line(self) -> str:
        """The warning, as rank 0 prints it and ``parse_notice`` reads it."""
        return (
            f"{MARKER}rank {self.rank} on {self.host} busy {self.ratio:.2f}x the median over "
            f"steps {self.first_step}-{self.last_step} ({self.busy_s:.3f} s vs "
            f"{self.median_s:.3f} s)"
        )


def parse_notice(text: str) -> StragglerNotice | None:
    """The notice in one output line ``text`` (a prefix before the marker allowed), or None."""
    if len(text) > MAX_LINE_CHARS:
        return None
    start = text.find(MARKER)
    match = NOTICE.fullmatch(text, start) if start >= 0 else None
    if match is None:
        return None
    first, last = int(match["first"]), int(match["last"])
    if not 1 <= first <= last <= MAX_STEP:
        return None
    return StragglerNotice(
        rank=int(match["rank"]),
        host=match["host"],
        ratio=float(match["ratio"]),
        first_step=first,
        last_step=last,
        busy_s=float(match["busy"]),
        median_s=float(match["median"]),
    )
