"""``benchmarks/bench_broadcast.py`` in its quick mode, through ``python -m benchmarks broadcast``
as ``make bench`` runs it: over the test sshd, star, tree and tree + compress each send the same
folder, and the figures say what each read (so the benchmark's own code is tested)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from goodput.testing.jobs import REPO
from goodput.testing.sshd import sshd_answers

pytestmark = pytest.mark.skipif(
    not sshd_answers(),
    reason="needs the test sshd (apt: openssh-server openssh-client rsync zstd; .ci/start-sshd)",
)


@pytest.mark.timeout(300)
def test_the_quick_benchmark_runs_and_counts_the_reads(tmp_path: Path) -> None:
    env = {**os.environ, "GOODPUT_BENCH_QUICK": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "broadcast"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "bench-out" / "results.json").read_text())["broadcast"]
    star, tree, compressed = figures["star"], figures["tree"], figures["tree+compress"]
    # Star: both hosts from the origin, each packing the source; tree: one, then host to host.
    assert star["copies_from_origin"] == 2 and tree["copies_from_origin"] == 1
    assert star["source_bytes_read"] == pytest.approx(2 * tree["source_bytes_read"], rel=0.05)
    # Compressed: the source read once (every byte of the layer at least), the archive sent.
    assert compressed["source_bytes_read"] >= figures["layer_bytes"]
    assert compressed["source_bytes_read"] <= tree["source_bytes_read"]
    assert figures["archive_bytes"] < figures["layer_bytes"]  # the layer is repetitive text
    assert "/goodput-layers/" in figures["imported_from"]
    assert all(figures[name]["seconds"] > 0 for name in ("star", "tree", "tree+compress"))
    # The crossover by the tree's rounds: compressing pays from some host count, or never.
    wins_from = figures["crossover"]["compress_wins_from_hosts"]
    cheaper = figures["crossover"]["t_zstd_s"] < figures["crossover"]["t_copy_s"]
    assert wins_from is None or (cheaper and wins_from >= 1)
