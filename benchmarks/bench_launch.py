"""Launch overhead against the bare launcher, and how fast the idle watchdog fires.

Overhead. The same 2-rank job, a Python child that prints its rank and exits, timed from exec
to exit: ``goodput launch -- CMD`` against the bare command, side by side, ``REPEATS`` times,
order alternating; figure = median of each, ratio = median ours / median bare. Two baselines:
MPICH's ``mpiexec -n 2`` under a faked PBS allocation of this host (``goodput launch`` then runs
the same ``mpiexec``: what it adds is its own start-up, planning and output streaming), and for
the local launcher, two bare ``python`` children started together by a ``subprocess`` loop.
Real srun needs a Slurm cluster and is measured the same way by the tests' salloc run, not here.

Watchdog latency. ``run_attempt`` on a child that prints its clock once and then sleeps
forever, with ``idle_timeout_s = T``: latency = the attempt's end minus the child's printed
time, less T (the watchdog's polling and the stop: SIGTERM, the child's exit, the readers'
end), median of ``REPEATS``.
"""

from __future__ import annotations

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
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
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
        figures = {**_overhead(Path(tmp)), **_watchdog_latency()}
    print(
        f"launch overhead (2 ranks, exec to exit, median of {REPEATS}): "
        f"mpiexec {figures['mpiexec_s']:.3f} s, goodput launch under PBS "
        f"{figures['ours_pbs_s']:.3f} s ({figures['ratio_pbs']:.2f}x); two bare children "
        f"{figures['bare_local_s']:.3f} s, goodput launch --nproc 2 "
        f"{figures['ours_local_s']:.3f} s ({figures['ratio_local']:.2f}x)"
    )
    print(
        f"idle watchdog: fires {figures['latency_s']:.3f} s after the configured "
        f"{IDLE_TIMEOUT_S:.0f} s of silence (median of {REPEATS})"
    )
    return figures
