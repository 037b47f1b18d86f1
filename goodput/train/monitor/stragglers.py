"""Busy time per rank, and the straggler watch that names a rank lagging the others.

Busy time of a rank in a step (``BusyClock``): the wall time from the start of its data phase
to the step's vote, less the in-loop eval (timed apart), less the time it waited in
collectives (the beacon's ``waited_ns``, ``goodput.beacon``; the eval's waits are the eval's).
A slow rank hardly waits and its peers wait as long as it lags, so on gloo (where a collective
blocks until the last peer arrives) this names the slow one: sleeps, data reads and compute
count as busy. On CUDA it is the host's view (kernels launched, not finished); NCCL timing is
left for a GPU check. Rank 0's logging is not in it: the vote comes before ``metrics.step``.

Every rank's busy time reaches every rank with the step's vote (``train.step_vote``, the
``busy_s`` of each ``Ballot`` and of the ``Tally``): no collective of its own.
``StragglerWatch`` then runs the same on every rank from the same numbers, so every rank holds
the same straggler state (what eviction needs):

- each step: the least, median and most busy time over ranks and the slowest rank (and host),
  into the step's metrics (``runfiles.MEASURED``: ``busy_s_*``, ``busy_slowest_*``);
- each window of ``[watch] straggler_steps`` steps (counted from this process's second step:
  the first is warm-up, allocations and the data loader's start, and uneven across ranks):
  each rank's mean busy time over the mean of the steps' medians; a rank past
  ``straggler_ratio`` gets one ``warning: straggler:`` line (``stragglers_line``) from rank 0,
  once per lag (named again only after a window back at or under the ratio), and the window's
  step records ``straggler_rank``/``straggler_ratio`` (the worst, when several); rank 0 appends
  the window's busy time per host to ``busy.jsonl`` (``runfiles.BusyLine``).

A window holds running sums (one float per rank), never the steps themselves. A single rank
has no median to lag: its busy time is recorded, no window is judged. With
``GOODPUT_EVICT_STRAGGLERS=1`` (``goodput launch --evict-stragglers``) and a straggler named,
``evicts`` says the loop's next periodic save is the last: blocking, then ``evicted``'s error
(exit code 4, ``ExitCode.STRAGGLER``) so the launcher replaces that host.
"""

from __future__ import annotations

import statistics
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
from goodput.runfiles import BusyLine, HostBusy, json_line
from goodput.stragglers_line import StragglerNotice
from goodput.train.config.run import WatchConfig


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


class StragglerWatch:
    """The straggler state of the run, the same on every rank; rank 0 prints and writes."""

    def __init__(self, cfg: WatchConfig, hosts: Sequence[str], *, rank: int, run_dir: Path):
        self.cfg, self.hosts, self.rank = cfg, list(hosts), rank
        self.busy_file = run_dir / rundir.BUSY
        self.warned: set[int] = set()  # ranks lagging since they were named: once per lag
        self.named: StragglerNotice | None = None  # the first straggler named
        self.warmed_up = False  # this process's first step is never judged
        self._clear()

    def _clear(self) -> None:
        self.sums = [0.0] * len(self.hosts)
        self.median_sum, self.num_steps, self.first_step = 0.0, 0, 0

    def observe(self, step: int, shares: Sequence[float]) -> dict[str, float | int | str]:
        """Step ``step``'s busy times (``shares``, by rank): its metrics fields, and a window's
        judgement when the window is full."""
        assert len(shares) == len(self.hosts), (len(shares), len(self.hosts))
        median = statistics.median(shares)
        slowest = max(range(len(shares)), key=shares.__getitem__)
        fields: dict[str, float | int | str] = {
            "busy_s_min": min(shares),
            "busy_s_median": median,
            "busy_s_max": shares[slowest],
            "busy_slowest_rank": slowest,
            "busy_slowest_host": self.hosts[slowest],
        }
        if len(shares) == 1 or not self.warmed_up:
            self.warmed_up = True
            return fields
        if self.num_steps == 0:
            self.first_step = step
        self.sums = [total + share for total, share in zip(self.sums, shares, strict=True)]
        self.median_sum += median
        self.num_steps += 1
        if self.num_steps == self.cfg.straggler_steps:
            fields |= self._judge(step)
            self._clear()
        return fields

    def _judge(self, step: int) -> dict[str, float | int]:
        means = [total / self.num_steps for total in self.sums]
        median = self.median_sum / self.num_steps
        if self.rank == 0:
            self._write_busy(step, means)
        if median <= 0:
            return {}
        notices = [
            StragglerNotice(
                rank=rank,
                host=self.hosts[rank],
                ratio=mean / median,
                first_step=self.first_step,
                last_step=step,
                busy_s=mean,
                median_s=median,
            )
            for rank, mean in sorted(enumerate(means), key=lambda item: -item[1])
            if mean / median > self.cfg.straggler_ratio and rank not in self.warned
        ]
        # A rank a whole window back at or under the ratio is named again when it next lags: a
        # transient straggler (a throttled node; goodput chaos's slow faults) each time.
        ratio = self.cfg.straggler_ratio
        self.warned = {rank for rank, mean in enumerate(means) if mean / median > ratio}
        for notice in notices:
            if self.rank == 0:
                print_line(notice.line())
        if not notices:
            return {}
        self.named = self.named or notices[0]
        return {"straggler_rank": notices[0].rank, "straggler_ratio": notices[0].ratio}

    def _write_busy(self, step: int, means: list[float]) -> None:
        by_host: dict[str, list[float]] = {}
        for host, mean in zip(self.hosts, means, strict=True):
            by_host.setdefault(host, []).append(mean)
        line = BusyLine(
            step=step,
            steps=self.num_steps,
            hosts=tuple(
                HostBusy(host, statistics.fmean(values), min(values), max(values))
                for host, values in by_host.items()
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
