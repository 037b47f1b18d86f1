"""A run directory at the seed's scale, synthetic: what ``goodput report`` is checked on at
any size (``tests/unit/report/test_report_at_scale.py``, a CI-sized one) and measured on at
Aurora's (``python -m benchmarks control``, section ``report at scale``: 10,624 hosts of 12
ranks, 100,000 steps, a straggler-watch window every 20 steps).

``write_scale_run`` writes ``metrics.jsonl`` and ``attempts.jsonl`` through ``run_dirs`` (the
trainer's and the launcher's lines, each attempt naming every host) with the straggler watch's
per-step keys (``busy_s_*``, ``busy_slowest_*``; ``straggler_*`` where a window names one), and
``busy.jsonl`` through ``runfiles.BusyLine``, a line a window. The ranks' busy times are drawn
from a seeded generator, not simulated rank by rank (127,488 ranks x 100,000 steps would be the
test's whole time): a window's quantiles drift slowly around 0.40 s, and its slowest ranks are
mostly ranks that lag once (each named in a window or two, as on a real machine), beside two
that ``STORY`` makes lag for long: ``STEADY`` over the middle of the run, ``FLAPPING`` every
tenth window throughout.

``measure_goodput`` runs one ``goodput`` command in a child of its own and measures it: its wall
and CPU seconds and its peak resident memory.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from goodput import rundir, runfiles
from goodput.runfiles import BusyLine, RankBusy
from goodput.testing.jobs import outside_any_job
from goodput.testing.proc import status_kib
from goodput.testing.run_dirs import Attempt, write_run

T0 = 1_800_000_000.0
STEP_TIME_S = 0.5
MEDIAN_S = 0.40  # the ranks' median busy time a step
LAG_RATIO = 1.6  # how much slower a straggler of the story is than the median
QUEUE_S = 300.0  # between one attempt's end and the next's start


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleRun:
    """The run's shape: Aurora's and the issue's by default."""

    hosts: int = 10_624
    ranks_per_host: int = 12
    steps: int = 100_000
    window: int = 20  # [watch] straggler_steps: a busy.jsonl line every this many steps
    attempts: int = 10  # jobs of a chain, each to its walltime, the last one done
    seed: int = 41

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    def host(self, rank: int) -> str:
        return f"x{rank // self.ranks_per_host:05d}"

    @property
    def steady(self) -> int:
        """The rank that lags from 30% to 60% of the run (a throttled node)."""
        return self.ranks // 3 + 5

    @property
    def flapping(self) -> int:
        """The rank that lags every tenth window (a noisy neighbour)."""
        return (2 * self.ranks) // 3 + 7


def write_scale_run(run_dir: Path, shape: ScaleRun) -> None:
    """``run_dir`` as the run of ``shape`` leaves it (the module docstring)."""
    windows = busy_windows(shape)
    hosts = tuple(f"x{index:05d}" for index in range(shape.hosts))
    per_attempt = -(-shape.steps // shape.attempts)
    attempts, clock = [], T0
    for index in range(shape.attempts):
        first, last = index * per_attempt + 1, min(shape.steps, (index + 1) * per_attempt)
        done = index == shape.attempts - 1
        attempt = Attempt(
            start=clock, startup_s=60.0, steps=range(first, last + 1), step_time_s=STEP_TIME_S,
            tail_s=10.0, class_="success" if done else "walltime", exit_code=0 if done else 143,
            job=str(1000 + index), wait_s=None if done else 0.0, host=hosts[0], hosts=hosts,
        )  # fmt: skip
        attempts.append(attempt)
        clock = attempt.end() + QUEUE_S

    def measured(step: int) -> dict[str, object]:
        window = windows[min(len(windows), -(-step // shape.window)) - 1]
        slowest = window.slowest[0]
        fields: dict[str, object] = {
            "busy_s_min": window.quantiles[0],
            "busy_s_median": window.quantiles[2],
            "busy_s_max": slowest.mean_s,
            "busy_slowest_rank": slowest.rank,
            "busy_slowest_host": slowest.host,
        }
        if step == window.step and slowest.mean_s > 1.2 * window.quantiles[2]:
            fields["straggler_rank"] = slowest.rank
            fields["straggler_ratio"] = slowest.mean_s / window.quantiles[2]
        return fields

    write_run(run_dir, attempts, checkpoints=range(1000, shape.steps + 1, 1000), done=True,
              measured=measured)  # fmt: skip
    with (run_dir / rundir.BUSY).open("w") as file:
        for line in windows:
            file.write(runfiles.json_line(line.as_json(), where=file.name))


def busy_windows(shape: ScaleRun) -> list[BusyLine]:
    """Every window's ``busy.jsonl`` line, as the straggler watch writes it."""
    draw = random.Random(shape.seed)
    count = min(runfiles.SLOWEST, shape.ranks)
    lines = []
    for index, step in enumerate(range(shape.window, shape.steps + 1, shape.window)):
        progress = step / shape.steps
        # A slow drift (the data's sequence lengths, say) and a little noise.
        median = MEDIAN_S * (1 + 0.03 * math.sin(6 * math.pi * progress) + 0.003 * draw.random())
        lagging = {
            draw.randrange(shape.ranks): median * draw.uniform(1.05, 1.3) for _ in range(count)
        }
        if 0.3 <= progress < 0.6:
            lagging[shape.steady] = median * LAG_RATIO * draw.uniform(0.97, 1.03)
        if index % 10 == 0:
            lagging[shape.flapping] = median * LAG_RATIO * draw.uniform(0.9, 1.1)
        named = sorted(lagging.items(), key=lambda item: -item[1])[:count]
        top = named[0][1]
        lines.append(
            BusyLine(
                step=step,
                steps=shape.window,
                ranks=shape.ranks,
                quantiles=(median * 0.9, median * 0.98, median, median * 1.02, top),
                slowest=tuple(RankBusy(rank, shape.host(rank), mean) for rank, mean in named),
            )
        )
    return lines


@dataclass(frozen=True, slots=True)
class Measured:
    """One ``goodput`` process: how it ended, what it printed, and what it took."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float  # user + system: on a shared machine, less noisy than the wall time
    peak_rss_mib: float  # the most resident memory it held (``ru_maxrss``)


def measure_goodput(*argv: object, timeout: float = 600) -> Measured:
    """``python -m goodput ARGV`` in a child of its own (outside any job), measured."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-m", "goodput", *map(str, argv)],
            stdout=out, stderr=err, env=outside_any_job(),
        )  # fmt: skip
        # Reaped here by wait4, not by Popen, for the child's own CPU time. Its peak memory is
        # its VmHWM, read while it runs: wait4's ru_maxrss keeps the parent's peak at the fork
        # (Linux carries it across exec), which in a benchmark that grew first is the parent's.
        peak_kib = 0
        while not (ended := os.wait4(child.pid, os.WNOHANG))[0]:
            if time.perf_counter() - started > timeout:
                child.kill()
                os.wait4(child.pid, 0)
                child.returncode = -9
                raise subprocess.TimeoutExpired(child.args, timeout)
            peak_kib = max(peak_kib, status_kib("VmHWM", child.pid))
            time.sleep(0.01)
        _, status, usage = ended
        child.returncode = os.waitstatus_to_exitcode(status)
        wall_s = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        return Measured(
            returncode=child.returncode,
            stdout=out.read().decode(),
            stderr=err.read().decode(),
            wall_s=wall_s,
            cpu_s=usage.ru_utime + usage.ru_stime,
            peak_rss_mib=peak_kib / 1024,
        )
