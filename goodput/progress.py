"""Progress reporting for long work: a live bar on a terminal, plain periodic lines otherwise.

Writes to stderr so stdout stays machine-readable; ``print_line`` is for the lines that are
stdout's (step lines, checkpoint reports), written whole. Rates are computed from the counters the
caller passes; nothing here knows what is being counted.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def print_line(text: str) -> None:
    """``text`` and its newline to stdout in one write, flushed: ``print`` writes the two apart,
    so a line printed from another thread (the checkpoint flush) could land between them and
    splice two lines into one, which the launcher's ``step=`` reading then misses."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class Progress:
    """``with Progress("tokenize", total_bytes=n) as p: p.update(docs=d, tokens=t, nbytes=b)``."""

    def __init__(
        self,
        label: str,
        *,
        total_bytes: int = 0,
        stream: TextIO | None = None,
        interval_s: float | None = None,
    ):
        self.label = label
        self.total_bytes = total_bytes
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self.interval_s = interval_s if interval_s is not None else (0.2 if self.live else 10.0)
        self.docs = self.tokens = self.nbytes = 0
        self.start = self.last = time.monotonic()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.emit(final=True)
        elif self.live:  # end the bar's line so the error that follows starts clean
            self.stream.write("\n")

    def update(self, *, docs: int = 0, tokens: int = 0, nbytes: int = 0) -> None:
        self.docs += docs
        self.tokens += tokens
        self.nbytes += nbytes
        now = time.monotonic()
        if now - self.last >= self.interval_s:
            self.last = now
            self.emit()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        done = ""
        if self.total_bytes:
            frac = min(self.nbytes / self.total_bytes, 1.0)
            bar = "#" * int(frac * 20)
            done = f"[{bar:<20}] {frac:6.1%} "
        return (
            f"{self.label}: {done}{self.docs:,} docs, {self.tokens:,} tokens, "
            f"{self.tokens / elapsed:,.0f} tok/s, {self.nbytes / elapsed / 1e6:.1f} MB/s, "
            f"{elapsed:.0f}s"
        )

    def emit(self, final: bool = False) -> None:
        if self.live:
            end = "\n" if final else ""
            self.stream.write("\r\x1b[K" + self.line() + end)
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()
