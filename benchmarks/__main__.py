"""``make bench``: every benchmark, each ours against its named baseline in one run.

Figures are printed and also written to ``bench-out/results.json`` for the README.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from benchmarks import bench_blend, bench_tokenize
from goodput.io import write_json


def main() -> None:
    machine = f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores"
    results = {"machine": machine, "tokenize": bench_tokenize.main(), "blend": bench_blend.main()}
    write_json(Path("bench-out/results.json"), results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
