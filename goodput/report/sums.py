"""Sums and means over numbers read from run files that no finite input makes overflow.

A run file admits any finite float (a diverged loss of 1e308, a busy time of 1e300 s), and two
of them already sum past float's largest (~1.8e308). ``headroom`` is the power of two that
keeps a sum of ``count`` such numbers in range: each is multiplied by it before it is added,
and the mean is divided by it after (``mean_of``). Where the numbers are of any sane size it is
1 and nothing changes. A power of two scales exactly, except a number that it takes below
float's normal range (2**-1022): that one loses low bits, which a sum of numbers near 2**1000
could not hold anyway. A mean is a finite number: rounding that would take it an ulp past
float's largest is clamped (``mean`` clamps to its values' least and most).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

# A scaled sum stays below 2**MAX_EXPONENT: half of float's range, room for its rounding.
MAX_EXPONENT = 1022


def headroom(largest: float, count: int) -> float:
    """A power of two ``s`` such that any sum of at most ``count`` numbers of magnitude at most
    ``largest`` (finite), each times ``s``, stays below ``2**MAX_EXPONENT``; 1.0 when the
    numbers need no scaling."""
    assert count >= 1 and math.isfinite(largest), (count, largest)
    _, exponent = math.frexp(abs(largest))  # abs(largest) < 2**exponent
    over = exponent + count.bit_length() - MAX_EXPONENT  # count < 2**bit_length
    return math.ldexp(1.0, -over) if over > 0 else 1.0


def mean_of(total: float, count: int, scale: float) -> float:
    """The mean of ``count`` numbers whose sum, each times ``scale`` (``headroom``), is
    ``total``: finite."""
    limit = sys.float_info.max
    return min(max(total / count / scale, -limit), limit)


def mean(values: Sequence[float]) -> float:
    """The mean of finite ``values`` (at least one), within their least and most."""
    scale = headroom(max(abs(value) for value in values), len(values))
    total = math.fsum(value * scale for value in values)  # exact partials: no drift
    return min(max(mean_of(total, len(values), scale), min(values)), max(values))
