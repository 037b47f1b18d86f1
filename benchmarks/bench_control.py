"""The control plane at the seed's scale: what goodput adds around the model's own work, one
section a function (``SECTIONS``).

Launcher fan-out (``launcher_fanout``). The health probe of every host (``failover.probe_hosts``)
and the hang forensics' collection (``suspects.collect_hosts``) of 2,048 and 10,624 hosts (Aurora
has 10,624 nodes), under the stand-in scheduler of the tests (``goodput.testing.jobs``: ``srun``
and ``mpiexec`` first on PATH, answering for every host they are given at once, as the real ones
running goodput's fan-out task do). Each run is a fresh launcher process, so that its figures are
its own: wall time, the most stand-in children alive at once (from their start and end lines),
the launcher's peak resident memory (``VmHWM``) and the most file descriptors it held (sampled
every millisecond), against the profile's ``health_timeout_s``. Three cases at each size: every
host healthy; one host down (every step naming it is refused, as Slurm refuses a down node's, so
the fan-out splits round it); forensics with a report of 12 ranks from every host (Aurora's 12
tiles a node). Slurm under the generic profile, PBS with Cray PALS under Aurora's.

Every rank's host at start (``rank_hosts_at_start``), at W = 8, 1,488, 8,192 and 127,488 ranks,
12 a host (Aurora's names, ``x1000c0s0b0n0``, 13 characters). Before: the launcher passed the
names comma-joined (srun's ``--nodelist``, every rank's ``GOODPUT_LAUNCH_HOSTS``), measured here
by exec'ing a command with that argument (E2BIG past 128 KiB), and every rank gathered every
rank's name (``all_gather_object``: W pickles, padded to the largest, to each of W ranks;
modelled from the measured pickle). After: one host file, its path in ``GOODPUT_HOSTFILE``; each
rank opens and reads it once (bytes measured) and expands it with no collective: the first
``every_rank_host`` of a fresh process timed, and what it keeps (the expanded tuple and the
host file's names and short names, shared) measured with ``sys.getsizeof``.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from goodput.launch.forensics import HostReport, RankReport
from goodput.launch.launchers import write_hosts
from goodput.ranks import HOSTFILE_VAR
from goodput.testing.jobs import peak_children, stand_in_scheduler

HOST_COUNTS = (2048, 10_624)
RANKS_PER_HOST = 12
LAUNCHERS = {"slurm": "generic", "pbs": "aurora"}  # launcher -> the profile it runs under

# The launcher under measure, in a process of its own: the case's fan-out, then its figures as
# one line of JSON.
DRIVER = """
import json, os, sys, threading, time
from pathlib import Path
from goodput.launch import failover, suspects
from goodput.launch.env import read_placement
from goodput.launch.launchers import load_profile, plan_launch

scheduler, profile, count, case, run_dir = sys.argv[1:]
hosts = [f"x{index:05d}" for index in range(int(count))]
if scheduler == "slurm":
    nodelist = f"x[00000-{int(count) - 1:05d}]"
    placement = read_placement({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": nodelist})
else:
    placement = read_placement({"PBS_JOBID": "1.pbs"}, "".join(h + "\\n" for h in hosts))
plan = plan_launch(placement, load_profile(profile), run_dir=Path(run_dir))
most_fds = 0
done = threading.Event()

def sample():
    global most_fds
    while not done.wait(0.001):
        most_fds = max(most_fds, len(os.listdir("/proc/self/fd")))

threading.Thread(target=sample, daemon=True).start()
started = time.monotonic()
if case == "forensics":
    reports = suspects.collect_hosts(plan, Path(run_dir) / "beacons", dict(os.environ))
    wrong = sorted(h for h, r in reports.items() if r is None or len(r.ranks) != 12)
else:
    failed = failover.probe_hosts(plan, plan.hosts, dict(os.environ))
    wrong = sorted(failed)
wall = time.monotonic() - started
done.set()
status = Path("/proc/self/status").read_text()
hwm = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
print(json.dumps({"wall_s": wall, "peak_rss_mib": hwm / 1024, "most_open_files": most_fds,
                  "wrong": wrong[:5], "timeout_s": plan.profile.health_timeout_s}))
"""


def _report(first_rank: int, world: int) -> str:
    ranks = tuple(
        RankReport(
            rank=rank, world_size=world, pid=4000 + rank, schedule_id=0, step=1234,
            phase="forward", last_site="step.tokens", entered=9000, left=8999, flush_site="",
            flush_entered=0, flush_left=0, torn=False, state="running", answered=True,
            stack=("distributed_c10d.py:2501 all_reduce", "loop.py:118 train", "cli.py:40 main"),
        )
        for rank in range(first_rank, first_rank + RANKS_PER_HOST)
    )  # fmt: skip
    return HostReport(ranks=ranks).to_json()


def _answers(count: int, case: str) -> dict[str, Any]:
    hosts = [f"x{index:05d}" for index in range(count)]
    if case == "forensics":
        world = count * RANKS_PER_HOST
        return {
            "hosts": {
                host: {"output": _report(index * RANKS_PER_HOST, world)}
                for index, host in enumerate(hosts)
            }
        }
    answers: dict[str, Any] = {"default": {"output": "health: {host}: healthy\n"}}
    if case == "one host down":
        answers["refuse"] = [hosts[count * 2 // 3]]
    return answers


def _one(tmp: Path, scheduler: str, count: int, case: str) -> dict[str, Any]:
    log = tmp / "stand-ins.log"
    log.unlink(missing_ok=True)
    run_dir = tmp / "run"
    run_dir.mkdir(exist_ok=True)
    env = {**os.environ, **stand_in_scheduler(tmp / "bin", _answers(count, case), log)}
    argv = [sys.executable, "-c", DRIVER, scheduler, LAUNCHERS[scheduler], str(count), case]
    result = subprocess.run(
        [*argv, str(run_dir)], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    figures: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    figures["steps"] = log.read_text().count("start ")
    figures["peak_children"] = peak_children(log)
    return figures


def launcher_fanout() -> dict[str, Any]:
    """Probes and forensics of 2,048 and 10,624 stand-in hosts (the module docstring)."""
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="goodput-bench-control-") as tmp:
        for scheduler in LAUNCHERS:
            for count in HOST_COUNTS:
                for case in ("all healthy", "one host down", "forensics"):
                    one = _one(Path(tmp), scheduler, count, case)
                    figures[f"{scheduler} {count} {case}"] = one
                    print(
                        f"launcher fan-out, {scheduler} ({LAUNCHERS[scheduler]}), {count:,} "
                        f"hosts, {case}: {one['wall_s']:.2f} s of {one['timeout_s']:g} s, "
                        f"{one['steps']} step(s), at most {one['peak_children']} at once, "
                        f"launcher peak RSS {one['peak_rss_mib']:.0f} MiB, at most "
                        f"{one['most_open_files']} open files; hosts failed {one['wrong']}"
                    )
    return figures


WORLD_SIZES = (8, 1488, 8192, 127_488)
MAX_ARG_STRLEN = 32 * os.sysconf("SC_PAGE_SIZE")  # Linux: one argument, or one NAME=VALUE
# One rank's start in a process of its own: its first every_rank_host, timed, and what it keeps.
RANK_AT_START = """
import json, os, sys, time
from goodput.ranks import every_rank_host, launch_hosts
world = int(sys.argv[1])
started = time.perf_counter()
every = every_rank_host(world, os.environ)
took = time.perf_counter() - started
names = launch_hosts(os.environ)
kept = {id(s): sys.getsizeof(s) for s in (*names, *every)}
kept_bytes = sys.getsizeof(every) + sys.getsizeof(names) * 2 + sum(kept.values())
print(json.dumps({"read_expand_ms": took * 1e3, "kept_bytes": kept_bytes,
                  "distinct_strings": len({id(s) for s in every})}))
"""


def _aurora_names(count: int) -> list[str]:
    return [f"x{1000 + i // 64}c{i // 8 % 8}s{i % 8}b0n0" for i in range(count)]


def _exec_with(argument: str) -> str:
    try:
        subprocess.run(["true", argument], check=True)
    except OSError as error:
        return errno.errorcode.get(error.errno or 0, str(error))
    return "ok"


def rank_hosts_at_start(world_sizes: tuple[int, ...] = WORLD_SIZES) -> dict[str, Any]:
    """Every rank's host at start, before and after (the module docstring)."""
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="goodput-bench-control-") as tmp:
        for world in world_sizes:
            names = _aurora_names(math.ceil(world / RANKS_PER_HOST))
            joined = f"GOODPUT_LAUNCH_HOSTS={','.join(names)}"
            pickled = max(len(pickle.dumps(name)) for name in names[-1:])
            path = write_hosts(Path(tmp), names)
            env = {**os.environ, HOSTFILE_VAR: str(path), "LOCAL_WORLD_SIZE": str(RANKS_PER_HOST)}
            rank = subprocess.run(
                [sys.executable, "-c", RANK_AT_START, str(world)],
                env=env, capture_output=True, text=True, timeout=600, check=True,
            )  # fmt: skip
            after = json.loads(rank.stdout)
            one = {
                "hosts": len(names),
                "before_longest_argument_bytes": len(joined),
                "before_exec": _exec_with(joined),
                "before_gathered_bytes_per_rank": world * pickled,
                "before_gathered_bytes_in_all": world * world * pickled,
                "after_longest_argument_bytes": len(f"{HOSTFILE_VAR}={path}"),
                "after_exec": _exec_with(f"{HOSTFILE_VAR}={path}"),
                "after_files_opened_per_rank": 1,
                "after_bytes_read_per_rank": path.stat().st_size,
                "after_bytes_read_in_all": world * path.stat().st_size,
                **after,
            }
            figures[f"W={world}"] = one
            print(
                f"rank hosts at start, W = {world:,} ({len(names):,} hosts): before: argument "
                f"{len(joined):,} B (exec {one['before_exec']}), gathered "
                f"{one['before_gathered_bytes_per_rank'] / 1e6:.2f} MB a rank, "
                f"{one['before_gathered_bytes_in_all'] / 1e9:.3g} GB in all; after: argument "
                f"{one['after_longest_argument_bytes']} B (exec {one['after_exec']}), 1 file of "
                f"{one['after_bytes_read_per_rank']:,} B a rank "
                f"({one['after_bytes_read_in_all'] / 1e9:.3g} GB in all), read and expanded in "
                f"{after['read_expand_ms']:.1f} ms, {after['kept_bytes'] / 1e6:.2f} MB kept, "
                f"{after['distinct_strings']:,} strings"
            )
    return figures


SECTIONS: dict[str, Callable[[], dict[str, Any]]] = {
    "launcher fan-out": launcher_fanout,
    "rank hosts at start": rank_hosts_at_start,
}


def main() -> dict[str, Any]:
    return {name: section() for name, section in SECTIONS.items()}
