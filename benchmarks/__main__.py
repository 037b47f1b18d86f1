"""``make bench``: every benchmark, each ours against its named baseline in one run.

``python -m benchmarks NAME ...`` runs only the named ones (``tokenize``, ``blend``, ``train``,
``checkpoint``, ``launch``, ``chaos``, ``layouts``, ``ring``, ``moe``, ``optim``, ``eval``,
``report``, ``init``, ``snapshot``, ``broadcast``, ``control``, ``ckpt``); no names: all. Figures
are printed and also written to ``bench-out/results.json`` for the README; a run of some
benchmarks replaces only their entries there, keeping the others'.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import (
    bench_blend,
    bench_broadcast,
    bench_chaos,
    bench_checkpoint,
    bench_ckpt_import,
    bench_control,
    bench_eval,
    bench_init,
    bench_launch,
    bench_layouts,
    bench_moe,
    bench_optim,
    bench_report,
    bench_ring,
    bench_snapshot,
    bench_tokenize,
    bench_train,
)
from goodput.io import write_json

BENCHMARKS: dict[str, Callable[[], Any]] = {
    "tokenize": bench_tokenize.main,
    "blend": bench_blend.main,
    "train": bench_train.main,
    "checkpoint": bench_checkpoint.main,
    "launch": bench_launch.main,
    "chaos": bench_chaos.main,
    "layouts": bench_layouts.main,
    "ring": bench_ring.main,
    "moe": bench_moe.main,
    "optim": bench_optim.main,
    "eval": bench_eval.main,
    "report": bench_report.main,
    "init": bench_init.main,
    "snapshot": bench_snapshot.main,
    "broadcast": bench_broadcast.main,
    "control": bench_control.main,
    "ckpt": bench_ckpt_import.main,
}
RESULTS = Path("bench-out/results.json")


def main(argv: Sequence[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv) or list(BENCHMARKS)
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        print(
            f"benchmarks: unknown {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}",
            file=sys.stderr,
        )
        return 2
    machine = f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores"
    results: dict[str, Any] = {"machine": machine}
    if set(names) != set(BENCHMARKS) and RESULTS.exists():
        results = {**json.loads(RESULTS.read_text()), **results}
    for name in names:
        results[name] = BENCHMARKS[name]()
    write_json(RESULTS, results)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
