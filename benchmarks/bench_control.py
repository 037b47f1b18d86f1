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

The report at scale (``report_at_scale``). ``goodput report RUN``, ``--json`` and ``--html`` on a
synthetic run of 10,624 hosts of 12 ranks and 100,000 steps with a straggler-watch window every
20 steps (``goodput.testing.scale_runs``: metrics.jsonl with the per-step busy keys, 5,000
busy.jsonl lines, ten attempts each naming every host), each a fresh process: wall and CPU
seconds and peak resident memory, against the issue's bound (10 s and 2 GiB each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from goodput.launch.forensics import HostReport, RankReport
from goodput.testing.jobs import peak_children, stand_in_scheduler
from goodput.testing.scale_runs import ScaleRun, measure_goodput, write_scale_run

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


REPORT_BOUND_S = 10.0  # the bound on each of goodput report's three forms at full size
REPORT_BOUND_MIB = 2048.0


def report_at_scale(shape: ScaleRun | None = None) -> dict[str, Any]:
    """``goodput report`` three ways on the run of ``shape`` (default: the issue's, the module
    docstring)."""
    shape = shape or ScaleRun()
    figures: dict[str, Any] = {"hosts": shape.hosts, "ranks": shape.ranks, "steps": shape.steps,
                               "windows": shape.steps // shape.window}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="goodput-bench-report-") as tmp:
        run_dir = Path(tmp) / "run"
        write_scale_run(run_dir, shape)
        sizes = {path.name: path.stat().st_size for path in run_dir.iterdir() if path.is_file()}
        figures["file_mib"] = {name: size / 2**20 for name, size in sorted(sizes.items())}
        forms = {"text": (), "json": ("--json",), "html": ("--html", Path(tmp) / "report.html")}
        for form, options in forms.items():
            one = measure_goodput("report", run_dir, *options)
            if one.returncode != 0:
                raise RuntimeError(f"goodput report {form}: {one.stderr.strip()[-500:]}")
            within = one.wall_s <= REPORT_BOUND_S and one.peak_rss_mib <= REPORT_BOUND_MIB
            figures[form] = {"wall_s": one.wall_s, "cpu_s": one.cpu_s,
                             "peak_rss_mib": one.peak_rss_mib, "within_bound": within}  # fmt: skip
            print(
                f"report at scale, {shape.hosts:,} hosts x {shape.ranks_per_host} ranks, "
                f"{shape.steps:,} steps, {figures['windows']:,} busy windows: goodput report "
                f"({form}) {one.wall_s:.2f} s wall, {one.cpu_s:.2f} s CPU, peak RSS "
                f"{one.peak_rss_mib:.0f} MiB (bound {REPORT_BOUND_S:g} s, "
                f"{REPORT_BOUND_MIB:,.0f} MiB: {'within' if within else 'PAST IT'})"
            )
    return figures


SECTIONS: dict[str, Callable[[], dict[str, Any]]] = {
    "launcher fan-out": launcher_fanout,
    "report at scale": report_at_scale,
}


def main() -> dict[str, Any]:
    return {name: section() for name, section in SECTIONS.items()}
