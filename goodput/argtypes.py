"""Number types for command-line options, checked when argparse reads them; ``renamed`` for an
option whose old spelling still works for one release.

argparse names the option in its error ("argument --timeout: 1e9 is not in [0, 315360000]")
and exits 2, so a NaN, an infinity, a negative count or a number beyond its range never reaches
the code behind the option; the message states the range the option takes. ``MAX_COUNT`` bounds
counts that size loops and allocations (hosts, ranks, samples), ``MAX_SECONDS`` durations and
the other plain numbers; an option whose code works in a narrower range says so with
``integer(low, high)`` or ``number(low, high, low_open=...)``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from goodput.errors import warn_deprecated

MAX_COUNT = 1 << 40  # far above any real count of hosts, ranks, tokens or samples
MAX_SECONDS = 10 * 365 * 86400.0  # a duration beyond ten years is a typo


def integer(low: int, high: int = MAX_COUNT) -> Callable[[str], int]:
    """A whole number in [low, high]; the error states that range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high}]")
        return value

    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


def number(low: float, high: float = MAX_SECONDS, *, low_open: bool) -> Callable[[str], float]:
    """A finite number from ``low`` (excluded when ``low_open``) to ``high``; the error states
    that range (NaN and infinities are outside every range)."""
    interval = f"{'(' if low_open else '['}{_show(low)}, {_show(high)}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        low_ok = value > low if low_open else value >= low
        if not (low_ok and value <= high):  # NaN fails both
            raise argparse.ArgumentTypeError(f"{text} is not in {interval}")
        return value

    parse.__name__ = f"number in {interval}"
    return parse


def _show(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


positive_int = integer(1)
non_negative_int = integer(0)
positive_float = number(0.0, low_open=True)
non_negative_float = number(0.0, low_open=False)


def add_renamed(parser: argparse.ArgumentParser, new: str, old: str, **options: Any) -> None:
    """Add option ``new`` (``options`` as for ``add_argument``) with ``old``, its former
    spelling, still accepted: the same value, and one deprecation line on stderr."""

    class Renamed(argparse.Action):
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: str | Sequence[Any] | None,
            option_string: str | None = None,
        ) -> None:
            if option_string == old:
                warn_deprecated(old, new)
            setattr(namespace, self.dest, values)

    parser.add_argument(new, old, action=Renamed, dest=new.lstrip("-").replace("-", "_"), **options)
