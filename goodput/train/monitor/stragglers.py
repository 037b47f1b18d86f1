"""Busy time per rank, and the straggler watch that names a rank lagging the others.

Busy time of a rank in a step (``BusyClock``): the wall time from the start of its data phase
to the step's vote, less the in-loop eval (timed apart), less the time it waited in
collectives (the beacon's ``waited_ns``, ``goodput.beacon``; the eval's waits are the eval's).
A slow rank hardly waits and its peers wait as long as it lags, so on gloo (where a collective
blocks until the last peer arrives) this names the slow one: sleeps, data reads and compute
count as busy. On CUDA it is the host's view (kernels launched, not finished); NCCL timing is
left for a GPU check. Rank 0's logging is not in it: the vote comes before ``metrics.step``.

What reaches every rank is fixed-size whatever the world size (``spread``): each step the
vote's ``Spread`` of busy times (``train.step_vote``: a histogram SUM and the extremes' MAX), and
each window one SUM and ``runfiles.SLOWEST`` MAX rounds (``Window``) that name the
slowest ranks. A rank's own numbers stay with it until it is named. ``StragglerWatch`` then
holds the same state on every rank (what eviction needs):

- each step: the least, median and most busy time over ranks and the slowest rank (and host),
  into the step's metrics (``runfiles.MEASURED``: ``busy_s_*``, ``busy_slowest_*``);
- each window of ``[watch] straggler_steps`` steps (counted from this process's second step:
  the first is warm-up, allocations and the data loader's start, and uneven across ranks):
  each rank judges its own mean busy time against the mean of the steps' medians (the same
  number on every rank); a rank past ``straggler_ratio`` gets one ``warning: straggler:`` line
  (``stragglers_line``) from rank 0, once per lag (named again only after a window back at or
  under the ratio), the ``SLOWEST`` slowest of them when more lag at once (a count of the
  rest follows), and the window's step records ``straggler_rank``/``straggler_ratio`` (the
  worst); rank 0 appends the window's spread over ranks (quantiles) and its ``SLOWEST``
  slowest ranks to ``busy.jsonl`` (``runfiles.BusyLine``).

A window holds running sums (this rank's busy time and the steps' medians), never the steps
themselves. A single rank
has no median to lag: its busy time is recorded, no window is judged. With
``GOODPUT_EVICT_STRAGGLERS=1`` (``goodput launch --evict-stragglers``) and a straggler named,
``evicts`` says the loop's next periodic save is the last: blocking, then ``evicted``'s error
(exit code 4, ``ExitCode.STRAGGLER``) so the launcher replaces that host.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from goodput import beacon, rundir
from goodput.checkpoint.save import Decision
from goodput.errors import ExitCode, GoodputError
from goodput.io import open_append
from goodput.progress import print_line
from goodput.ranks import EVICT_VAR
from goodput.runfiles import SLOWEST, BusyLine, RankBusy, json_line
from goodput.stragglers_line import StragglerNotice
from goodput.train.config.run import WatchConfig
from goodput.train.monitor.spread import (
    MAX_US,
    NOBODY,
    Spread,
    extremes,
    histogram,
    micros,
    pack,
    quantile,
    unpack,
)
from goodput.train.monitor.wire import Wire


class BusyClock:
    """This rank's busy time in the current step: ``start`` at the data phase, ``apart``
    around what is timed apart (the eval), ``seconds`` at the vote."""

    def __init__(self) -> None:
        self.started_s = self.apart_s = 0.0
        self.waited_ns = self.apart_waited_ns = 0

    def start(self) -> None:
        self.started_s, self.waited_ns = time.perf_counter(), beacon.current().waited_ns
        self.apart_s, self.apart_waited_ns = 0.0, 0

    @contextmanager
    def apart(self) -> Iterator[None]:
        started_s, waited_ns = time.perf_counter(), beacon.current().waited_ns
        try:
            yield
        finally:
            self.apart_s += time.perf_counter() - started_s
            self.apart_waited_ns += beacon.current().waited_ns - waited_ns

    def seconds(self) -> float:
        wall_s = time.perf_counter() - self.started_s - self.apart_s
        waited_ns = beacon.current().waited_ns - self.waited_ns - self.apart_waited_ns
        return max(0.0, wall_s - waited_ns / 1e9)


class Window:
    """Collective: a window's slowest ranks and its least, in ``SLOWEST`` MAX rounds
    over the ranks (each round's winners sit the next ones out): ``slowest`` (microseconds,
    rank), slowest first; ``newly`` the same of the ``num_new`` ranks newly past the ratio
    (the first ``SLOWEST``); ``least_us`` the least mean."""

    def __init__(self, wire: Wire, mean_us: int, newly: bool, *, num_new: int) -> None:
        self.num_new = num_new
        self.slowest: list[tuple[int, int]] = []
        self.newly: list[tuple[int, int]] = []
        self.least_us = 0
        rank = wire.rank
        # SLOWEST rounds at any world size (past its ranks they find nobody): the bytes a
        # rank sends are the same at 2 ranks and at 127,488.
        for turn in range(SLOWEST):
            mine = pack(mean_us, rank)
            parts = [
                NOBODY if (mean_us, rank) in self.slowest else mine,
                mine if newly and (mean_us, rank) not in self.newly else NOBODY,
                extremes(mean_us, rank)[1] if turn == 0 else NOBODY,
            ]
            got = wire.reduce(parts, "max", "busy.window")
            if got[0] != NOBODY:
                self.slowest.append(unpack(got[0]))
            if got[1] != NOBODY:
                self.newly.append(unpack(got[1]))
            if turn == 0:
                self.least_us = MAX_US - unpack(got[2])[0]


class StragglerWatch:
    """The straggler state of the run, the same on every rank; rank 0 prints and writes."""

    def __init__(self, cfg: WatchConfig, hosts: Sequence[str], wire: Wire, *, run_dir: Path):
        self.cfg, self.hosts, self.wire = cfg, hosts, wire
        self.busy_file = run_dir / rundir.BUSY
        self.lagging = False  # this rank lagged in the last window: named once per lag
        self.named: StragglerNotice | None = None  # the first straggler named
        self.warmed_up = False  # this process's first step is never judged
        self._clear()

    def _clear(self) -> None:
        self.own_us = 0  # this rank's busy time over the window, whole microseconds
        self.median_sum_us, self.num_steps, self.first_step = 0.0, 0, 0

    def observe(self, step: int, busy_s: float, busy: Spread) -> dict[str, float | int | str]:
        """Step ``step``'s busy time here (``busy_s``) and over the ranks (``busy``, the
        vote's): its metrics fields, and a window's judgement when the window is full."""
        fields: dict[str, float | int | str] = {
            "busy_s_min": busy.min_s,
            "busy_s_median": busy.median_s,
            "busy_s_max": busy.max_s,
            "busy_slowest_rank": busy.slowest_rank,
            "busy_slowest_host": self.hosts[busy.slowest_rank],
        }
        if self.wire.world_size == 1 or not self.warmed_up:
            self.warmed_up = True
            return fields
        if self.num_steps == 0:
            self.first_step = step
        self.own_us += micros(busy_s)
        self.median_sum_us += busy.median_s * 1e6
        self.num_steps += 1
        if self.num_steps == self.cfg.straggler_steps:
            fields |= self._judge(step)
            self._clear()
        return fields

    def _judge(self, step: int) -> dict[str, float | int]:
        """Collective: the window's spread of mean busy times, its slowest ranks and the ranks
        newly past the ratio, in a SUM and ``SLOWEST`` MAX rounds (see the module
        docstring); rank 0 prints the notices and writes the window to ``busy.jsonl``."""
        mean_us = round(self.own_us / self.num_steps)
        median_us = self.median_sum_us / self.num_steps
        lagging = median_us > 0 and mean_us / median_us > self.cfg.straggler_ratio
        newly = lagging and not self.lagging  # a rank back at pace for a window is named again
        self.lagging = lagging
        summed = self.wire.reduce(histogram(mean_us) + [int(newly)], "sum", "busy.window")
        window = Window(self.wire, mean_us, newly, num_new=summed[-1])
        if self.wire.rank == 0:
            self._write_busy(step, summed[:-1], window)
        if median_us <= 0:
            return {}
        notices = [
            StragglerNotice(
                rank=rank,
                host=self.hosts[rank],
                ratio=us / median_us,
                first_step=self.first_step,
                last_step=step,
                busy_s=us / 1e6,
                median_s=median_us / 1e6,
            )
            for us, rank in window.newly
        ]
        if self.wire.rank == 0:
            for notice in notices:
                print_line(notice.line())
            if window.num_new > len(notices):
                print_line(
                    f"warning: {window.num_new - len(notices)} more ranks past "
                    f"{self.cfg.straggler_ratio:g}x the median busy time over steps "
                    f"{self.first_step}-{step} ({rundir.BUSY} has their spread)"
                )
        if not notices:
            return {}
        self.named = self.named or notices[0]
        return {"straggler_rank": notices[0].rank, "straggler_ratio": notices[0].ratio}

    def _write_busy(self, step: int, bins: list[int], window: Window) -> None:
        least, most = window.least_us, window.slowest[0][0]
        p25, median, p75 = (min(most, max(least, quantile(bins, q))) for q in (0.25, 0.5, 0.75))
        line = BusyLine(
            step=step,
            steps=self.num_steps,
            ranks=self.wire.world_size,
            quantiles=(least / 1e6, p25 / 1e6, median / 1e6, p75 / 1e6, most / 1e6),
            slowest=tuple(
                RankBusy(rank, self.hosts[rank], us / 1e6) for us, rank in window.slowest
            ),
        )
        with open_append(self.busy_file) as file:
            file.write(json_line(line.as_json(), where=self.busy_file))

    def evicts(self, decision: Decision, environ: Mapping[str, str]) -> bool:
        """Whether this periodic save is the last, to have the straggler's host replaced."""
        return (
            decision is Decision.PERIODIC
            and self.named is not None
            and environ.get(EVICT_VAR) == "1"
        )

    def evicted(self, step: int) -> GoodputError:
        """The stop after the save of ``step`` that ``evicts`` asked for."""
        named = self.named
        assert named is not None
        return GoodputError(
            "train",
            f"stopping after the save of step {step} to replace straggler rank {named.rank} on "
            f"{named.host}",
            "goodput launch --auto-retry --evict-stragglers resumes the run on a spare host",
            code=ExitCode.STRAGGLER,
        )
