"""Number types for command-line options, checked when argparse reads them; ``renamed`` for an
option whose old spelling still works for one release.

argparse names the option in its error ("argument --timeout: ...") and exits 2, so a NaN, an
infinity, a negative count or a number beyond ``MAX_COUNT`` never reaches the code behind the
option. ``MAX_COUNT`` bounds counts that size loops and allocations (hosts, ranks, samples).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

MAX_COUNT = 1 << 40  # far above any real count of hosts, ranks, tokens or samples
MAX_SECONDS = 10 * 365 * 86400.0  # a duration beyond ten years is a typo


def _integer(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not minimum <= value <= MAX_COUNT:
            raise argparse.ArgumentTypeError(f"{value} is not in [{minimum}, {MAX_COUNT}]")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _number(minimum: float, *, inclusive: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        low_ok = value >= minimum if inclusive else value > minimum
        if not math.isfinite(value) or not low_ok or value > MAX_SECONDS:
            bound = f"{'>=' if inclusive else '>'} {minimum:g}"
            raise argparse.ArgumentTypeError(f"{text} is not a finite number {bound}")
        return value

    parse.__name__ = f"number >= {minimum:g}"
    return parse


positive_int = _integer(1)
non_negative_int = _integer(0)
positive_float = _number(0.0, inclusive=False)
non_negative_float = _number(0.0, inclusive=True)


def renamed(old: str, new: str) -> type[argparse.Action]:
    """``action=`` for an option renamed from ``old`` to ``new`` (both option strings of the
    one argument): the old spelling stores the same value and prints one deprecation line."""

    class Renamed(argparse.Action):
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: str | Sequence[Any] | None,
            option_string: str | None = None,
        ) -> None:
            if option_string == old:
                print(f"goodput: warning: {old} is deprecated; use {new}", file=sys.stderr)
            setattr(namespace, self.dest, values)

    return Renamed
