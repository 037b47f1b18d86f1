"""One number per rank, summed up in a fixed number of integers whatever the world size: the
shape of the busy times that the step's vote and the straggler watch hand every rank.

Times travel in whole microseconds (``micros``), so sums are exact and the same on every rank
in whatever order a reduction adds them. A ``Spread`` is two things reduced over the ranks:

- a histogram (``histogram``: a SUM), ``BINS`` bins each holding a count and the sum of its
  values: eight bins an octave (each at most 1/8 of its octave wide) from 1 µs to 2^36 µs (19
  hours; a time past it counts as that), bin 0 the times under 1 µs. A quantile (``quantile``)
  is read where its rank in order falls, as the mean of that bin's values: exact when the
  ranks there share one value (a healthy world's median), else within the bin;
- the least and the most, each with its rank (``extremes``: a MAX of packed integers,
  ``pack``), exact.

``Spread.of`` reads both. 2 x 289 + 2 integers: 4.6 KB at any world size, where one float a
rank was 1 MB at 127,488 ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BINS_PER_OCTAVE = 8
OCTAVES = 36
BINS = 1 + OCTAVES * BINS_PER_OCTAVE
MAX_US = 2**OCTAVES - 1  # 19 hours: the most a time may count as
RANK_BITS = 24  # a packed value's low bits: ranks up to 2^24 (16.7 million)
MAX_RANKS = 2**RANK_BITS
NOBODY = -(2**62)  # a MAX slot's value from a rank with nothing to say: below every packed value


def micros(seconds: float) -> int:
    """``seconds`` in whole microseconds, within 0..``MAX_US``."""
    return min(MAX_US, max(0, round(seconds * 1e6)))


def bin_of(us: int) -> int:
    """The histogram bin of ``us`` microseconds: integers only, so every rank bins alike."""
    if us < 1:
        return 0
    octave = us.bit_length() - 1
    eighth = ((us << 3) >> octave) - BINS_PER_OCTAVE  # 0..7: where in its octave
    return 1 + octave * BINS_PER_OCTAVE + eighth


def histogram(us: int) -> list[int]:
    """This rank's part of the histogram SUM: a count of one and its value, in ``us``'s bin."""
    part = [0] * (2 * BINS)
    where = bin_of(us)
    part[where], part[BINS + where] = 1, us
    return part


def pack(us: int, rank: int) -> int:
    """``us`` and ``rank`` in one integer whose MAX over ranks is the most ``us`` and, among
    equals, the least rank."""
    return (us << RANK_BITS) | (MAX_RANKS - 1 - rank)


def unpack(packed: int) -> tuple[int, int]:
    """(us, rank) of a ``pack``ed value."""
    return packed >> RANK_BITS, MAX_RANKS - 1 - (packed & (MAX_RANKS - 1))


def extremes(us: int, rank: int) -> list[int]:
    """This rank's part of the extremes' MAX: the most (packed), then the least (packed as its
    distance below ``MAX_US``, so that the MAX finds it)."""
    return [pack(us, rank), pack(MAX_US - us, rank)]


def quantile(bins: Sequence[int], fraction: float) -> float:
    """Microseconds at ``fraction`` (0..1) of the ranks in order, from a reduced ``histogram``:
    the two ranks around it, each read as the mean of its bin, interpolated."""
    counts, sums = bins[:BINS], bins[BINS:]
    ranks = sum(counts)
    position = fraction * (ranks - 1)
    below = int(position)
    low, high = _value_at(counts, sums, below), _value_at(counts, sums, min(below + 1, ranks - 1))
    return low + (position - below) * (high - low)


def _value_at(counts: Sequence[int], sums: Sequence[int], index: int) -> float:
    seen = 0
    for where, count in enumerate(counts):
        seen += count
        if index < seen:
            return sums[where] / count
    raise AssertionError(f"index {index} past {seen} ranks")


@dataclass(frozen=True, slots=True, kw_only=True)
class Spread:
    """A number of every rank, as every rank sees it: how many ranks, the least, the median
    (within its bin, see the module docstring) and the most, in seconds, and the rank of the
    most."""

    ranks: int
    min_s: float
    median_s: float
    max_s: float
    slowest_rank: int

    @classmethod
    def of(cls, bins: Sequence[int], packed: Sequence[int]) -> Spread:
        """The spread from a reduced ``histogram`` and reduced ``extremes``."""
        most_us, slowest = unpack(packed[0])
        least_us = MAX_US - unpack(packed[1])[0]
        # The median within the exact extremes: a bin's mean cannot pass them, but say so.
        median_us = min(most_us, max(least_us, quantile(bins, 0.5)))
        return cls(
            ranks=sum(bins[:BINS]),
            min_s=least_us / 1e6,
            median_s=median_us / 1e6,
            max_s=most_us / 1e6,
            slowest_rank=slowest,
        )
