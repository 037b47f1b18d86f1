"""Launch overhead against the bare launcher, and how fast the idle watchdog fires.

Overhead. The same 2-rank job, a Python child that prints its rank and exits, timed from exec
to exit: ``goodput launch -- CMD`` against the bare command, side by side, ``REPEATS`` times,
order alternating; figure = median of each, ratio = median ours / median bare. Two baselines:
MPICH's ``mpiexec -n 2`` under a faked PBS allocation of this host (``goodput launch`` then runs
the same ``mpiexec``: what it adds is its own start-up, planning and output streaming), and for
the local launcher, two bare ``python`` children started together by a ``subprocess`` loop.
Where a Slurm node answers (CI starts one with ``.ci/start-slurm``), a third pair runs inside one
``salloc``: the bare ``srun`` line that ``goodput launch`` would run, against ``goodput launch``.

Watchdog latency. ``run_attempt`` on a child that prints its clock once and then sleeps
forever, with ``idle_timeout_s = T``: latency = the attempt's end minus the child's printed
time, less T (the watchdog's polling and the stop: SIGTERM, the child's exit, the readers'
end), median of ``REPEATS``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from goodput.launch.attempt import ProcessSpec, run_attempt
from goodput.launch.env import current_placement
from goodput.testing.jobs import outside_any_job

REPEATS = 5
IDLE_TIMEOUT_S = 1.0
CHILD = "import os; print('rank', os.environ.get('PMI_RANK', os.environ.get('RANK')))"


def _timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=120)
    return time.perf_counter() - start


def _two_bare_children(env: dict[str, str]) -> float:
    start = time.perf_counter()
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE
        )
        for r in range(2)
    ]
    for child in children:
        child.communicate(timeout=120)
    return time.perf_counter() - start


def _overhead(tmp: Path) -> dict[str, Any]:
    goodput = [sys.executable, "-m", "goodput", "launch", "--run-dir", str(tmp / "run")]
    env = outside_any_job()
    hostfile = tmp / "nodes"
    hostfile.write_text(f"{os.uname().nodename}\n")
    pbs = {**env, "PBS_JOBID": "1.bench", "PBS_NODEFILE": str(hostfile)}
    sides: dict[str, list[float]] = {
        k: [] for k in ("mpiexec", "ours_pbs", "bare_local", "ours_local")
    }
    for repeat in range(REPEATS):
        runs = [
            ("mpiexec", lambda: _timed(["mpiexec", "-n", "2", sys.executable, "-c", CHILD], env)),
            (
                "ours_pbs",
                lambda: _timed([*goodput, "--ppn", "2", "--", sys.executable, "-c", CHILD], pbs),
            ),
            ("bare_local", lambda: _two_bare_children(env)),
            (
                "ours_local",
                lambda: _timed([*goodput, "--nproc", "2", "--", sys.executable, "-c", CHILD], env),
            ),
        ]
        for side, run in runs if repeat % 2 == 0 else reversed(runs):
            sides[side].append(run())
    medians = {side: statistics.median(times) for side, times in sides.items()}
    return {
        **{f"{side}_s": value for side, value in medians.items()},
        "ratio_pbs": medians["ours_pbs"] / medians["mpiexec"],
        "ratio_local": medians["ours_local"] / medians["bare_local"],
    }


def _srun_sides() -> None:
    """Inside an allocation: the bare srun and goodput launch, alternating; medians as JSON."""
    (node,) = current_placement().hosts  # the one node of the salloc
    bare = ["srun", "--nodes", "1", "--ntasks", "2", "--ntasks-per-node", "2", "--nodelist", node]
    bare += ["--kill-on-bad-exit=1", sys.executable, "-c", CHILD]
    with tempfile.TemporaryDirectory(prefix="goodput-bench-") as tmp:
        ours = [sys.executable, "-m", "goodput", "launch", "--ppn", "2", "--run-dir", tmp]
        ours += ["--", sys.executable, "-c", CHILD]
        sides: dict[str, list[float]] = {"srun": [], "ours_slurm": []}
        for repeat in range(REPEATS):
            runs = [("srun", bare), ("ours_slurm", ours)]
            for side, argv in runs if repeat % 2 == 0 else reversed(runs):
                sides[side].append(_timed(argv, dict(os.environ)))
    print(json.dumps({f"{side}_s": statistics.median(times) for side, times in sides.items()}))


def _srun_overhead() -> dict[str, Any]:
    if shutil.which("salloc") is None:
        return {}
    salloc = ["salloc", "--nodes", "1", "--ntasks", "2", "--overcommit", "--time", "5"]
    program = "from benchmarks.bench_launch import _srun_sides; _srun_sides()"
    env = outside_any_job()
    try:
        done = subprocess.run(
            [*salloc, sys.executable, "-c", program],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return {}
    if done.returncode != 0:
        print(f"bench_launch: no srun figures (salloc: {done.stderr.strip()[-200:]})")
        return {}
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return {**figures, "ratio_slurm": figures["ours_slurm_s"] / figures["srun_s"]}


def _watchdog_latency() -> dict[str, Any]:
    child = "import time; print('alive', time.time(), flush=True); time.sleep(3600)"
    latencies = []
    for _ in range(REPEATS):
        spec = ProcessSpec([sys.executable, "-c", child], dict(os.environ), "0")
        with open(os.devnull, "wb") as sink:
            result = run_attempt([spec], idle_timeout_s=IDLE_TIMEOUT_S, grace_s=1.0, out=sink)
        ended = time.time()
        assert result.timed_out and result.exit_code == 124
        last_output = float(result.tail_lines[-1].split()[-1])  # the child's own timestamp
        latencies.append(ended - last_output - IDLE_TIMEOUT_S)
    return {"idle_timeout_s": IDLE_TIMEOUT_S, "latency_s": statistics.median(latencies)}


def main() -> dict[str, Any]:
    if shutil.which("mpiexec") is None:
        raise SystemExit("bench_launch needs MPICH's mpiexec (apt: mpich)")
    with tempfile.TemporaryDirectory(prefix="goodput-bench-") as tmp:
        figures = {**_overhead(Path(tmp)), **_srun_overhead(), **_watchdog_latency()}
    print(
        f"launch overhead (2 ranks, exec to exit, median of {REPEATS}): "
        f"mpiexec {figures['mpiexec_s']:.3f} s, goodput launch under PBS "
        f"{figures['ours_pbs_s']:.3f} s ({figures['ratio_pbs']:.2f}x); two bare children "
        f"{figures['bare_local_s']:.3f} s, goodput launch --nproc 2 "
        f"{figures['ours_local_s']:.3f} s ({figures['ratio_local']:.2f}x)"
    )
    if "srun_s" in figures:
        print(
            f"under Slurm: srun {figures['srun_s']:.3f} s, goodput launch "
            f"{figures['ours_slurm_s']:.3f} s ({figures['ratio_slurm']:.2f}x)"
        )
    print(
        f"idle watchdog: fires {figures['latency_s']:.3f} s after the configured "
        f"{IDLE_TIMEOUT_S:.0f} s of silence (median of {REPEATS})"
    )
    return figures
