"""Progress reporting for long work: a ``rich`` bar on a terminal, plain periodic lines otherwise.

One ``Progress`` for every long operation: a label, a total (or None when unknown) in a unit
(``bytes``, or any count: files, samples, hosts, requests), and optional counters beside it
(docs, tokens). Where stderr is a terminal it is a live ``rich.progress`` bar; elsewhere (a
batch log) a line every ``interval_s`` (10 s), and a closing line once any line was written, so
work done within one interval stays quiet. Both modes show the same text (``Progress.detail``).

It writes to stderr only, so stdout stays machine-readable; ``print_line`` is for the lines that
are stdout's (step lines, checkpoint reports), written whole. The bar never touches stdout
(``redirect_stdout=False``): the launcher reads the trainer's ``step=`` lines there, and nothing
that trains shows a live bar (``live=False``: the trainer's checkpoint saves and loads write
plain lines even on a terminal, where a bar would be redrawn through the step lines). Rates
are averages since the start, from the amounts the caller passes; nothing here knows what is
being counted. No torch; ``rich`` is imported only for a bar.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rich.console import Console

BYTES = "bytes"  # the unit shown as kB, MB, GB; any other unit is a plain count
PLAIN_INTERVAL_S = 10.0


def print_line(text: str) -> None:
    """``text`` and its newline to stdout in one write, flushed: ``print`` writes the two apart,
    so a line printed from another thread (the checkpoint flush) could land between them and
    splice two lines into one, which the launcher's ``step=`` reading then misses."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class Progress:
    """``with Progress("tokenize", total=n, unit="bytes") as p: p.advance(b, docs=d, tokens=t)``.

    ``console``: draw the bar through this ``rich`` console (tests pass one writing to a
    ``StringIO``); without it the bar is drawn when ``stream`` (default stderr) is a terminal.
    ``clock``: seconds, monotonic; the plain lines' interval and the rates are measured by it.
    ``interval_s``: between plain lines; ``PLAIN_INTERVAL_S`` when not given.
    ``show=False`` writes nothing (ranks other than 0 count along without a word);
    ``live=False`` writes plain lines on a terminal too.
    """

    def __init__(
        self,
        label: str,
        *,
        total: float | None = None,
        unit: str = "items",
        stream: TextIO | None = None,
        console: Console | None = None,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        show: bool = True,
        live: bool = True,
    ):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = PLAIN_INTERVAL_S if interval_s is None else interval_s
        self.clock, self.show = clock, show
        self.done = 0.0
        self.counts: dict[str, int] = {}  # in the order they first came
        self.start = self.last = clock()
        self.num_lines = 0  # plain lines written
        self._bar: Any = None  # rich.progress.Progress while live
        if show and live and (console is not None or self.stream.isatty()):
            self._bar = _rich_bar(console, self.stream, clock)
            self._task = self._bar.add_task(label, total=total, detail=self.detail())

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._bar is not None:
            self._bar.update(self._task, detail=self.detail())
            self._bar.stop()  # the last frame stays (elapsed in its column), its line ended
        elif exc_type is None and self.num_lines:
            self._write(final=True)

    def advance(self, amount: float = 0, **counts: int) -> None:
        """``amount`` more of the unit done; ``counts`` added to the counters of those names."""
        self.done += amount
        for name, count in counts.items():
            self.counts[name] = self.counts.get(name, 0) + count
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, detail=self.detail())
            return
        now = self.clock()
        if self.show and now - self.last >= self.interval_s:
            self.last = now
            self._write(final=False)

    def detail(self, final: bool = False) -> str:
        """The amount done, the counters and the rates: ``4 of 10 shards, 2 documents, 3 shards/s,
        1.5 documents/s``."""
        elapsed = max(self.clock() - self.start, 1e-9)
        if self.total is None:
            amount = _amount(self.done, self.unit)
        elif self.unit == BYTES:
            amount = f"{_bytes(self.done)} of {_bytes(self.total)}"
        else:
            amount = f"{self.done:,.0f} of {_amount(self.total, self.unit)}"
        counters = [f"{count:,} {name}" for name, count in self.counts.items()]
        rates = [_rate(self.done / elapsed, self.unit)]
        rates += [_rate(count / elapsed, name) for name, count in self.counts.items()]
        if final:
            return ", ".join([amount, *counters]) + f" in {_duration(elapsed)} ({', '.join(rates)})"
        return ", ".join([amount, *counters, *rates])

    def line(self, final: bool = False) -> str:
        """The plain line: label, percent (with a total), detail, elapsed (or time left)."""
        percent = ""
        if self.total:
            percent = f"{min(self.done / self.total, 1.0):.1%} "
        text = f"{self.label}: {percent}{self.detail(final)}"
        if final:
            return text
        elapsed = self.clock() - self.start
        text += f", {_duration(elapsed)}"
        if self.total and 0 < self.done < self.total:
            left = elapsed * (self.total - self.done) / self.done
            text += f", about {_duration(left)} left"
        return text

    def _write(self, final: bool) -> None:
        self.stream.write(self.line(final) + "\n")
        self.stream.flush()
        self.num_lines += 1


def _rich_bar(console: Console | None, stream: TextIO, clock: Callable[[], float]) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as Bar

    return Bar(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[detail]}", markup=False),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console if console is not None else Console(file=stream),
        get_time=clock,
        # stdout is the step lines' and the results'; stderr prints (a broadcast's retry line,
        # a warning) are drawn above the bar instead of through it.
        redirect_stdout=False,
        redirect_stderr=True,
    )


def _amount(value: float, unit: str) -> str:
    if unit == BYTES:
        return _bytes(value)
    return f"{value:,.0f} {unit}"


def _rate(per_s: float, unit: str) -> str:
    if unit == BYTES:
        return f"{_bytes(per_s)}/s"
    return f"{_short(per_s)} {unit}/s"


def _bytes(value: float) -> str:
    for suffix in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or suffix == "TB":
            return f"{value:.0f} {suffix}" if suffix == "B" else f"{value:.1f} {suffix}"
        value /= 1000
    raise AssertionError("unreachable")


def _short(value: float) -> str:
    """A rate in three figures or so: 0.5, 12, 3.4k, 120M."""
    for suffix in ("", "k", "M", "G"):
        if abs(value) < 1000 or suffix == "G":
            return f"{value:.1f}{suffix}" if abs(value) < 10 else f"{value:.0f}{suffix}"
        value /= 1000
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"
