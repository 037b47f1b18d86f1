"""Blend interleave: ``build_blend_index`` (EDF, in C) against the classic greedy it replaces.

Baseline: largest-deficit-first greedy as in Megatron-LM (``greedy_blend_index``, same C build,
O(N * D)). Input: N = 10^8 samples over D = 100 corpora with Dirichlet(1) weights, fixed seed.
Targets: EDF in <= 2 s on one core, peak memory <= 10 bytes a sample (the two outputs), every
aligned batch within 2 samples of its mixture.

Figures: EDF time is the median of ``REPEATS`` runs. The greedy runs once at 10^7 and once at
full N when the 10^7 run predicts under ``GREEDY_FULL_RUN_LIMIT_S``; otherwise its full-N time is
extrapolated linearly and its deviations are those of the 10^7 run, and the output says so. Peak
memory: in a fresh process, peak RSS (VmHWM; ``ru_maxrss`` without /proc) after one full-N EDF
build minus the RSS just before it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from goodput.data.interleave import build_blend_index, greedy_blend_index, max_batch_deviation
from goodput.testing.proc import status_kib
from goodput.train.device import process_peak_bytes

NUM_SAMPLES = 10**8
NUM_CORPORA = 100
SEED = 0
REPEATS = 3
GREEDY_PROBE_SAMPLES = 10**7
GREEDY_FULL_RUN_LIMIT_S = 60.0
BATCH_SIZES = (256, 1024)


def main(num_samples: int = NUM_SAMPLES, num_corpora: int = NUM_CORPORA) -> dict[str, Any]:
    """Runs the benchmark, prints a table and returns the figures."""
    weights = _weights(num_corpora)
    edf_times = []
    edf_index = np.empty(0, dtype=np.int16)
    for _ in range(REPEATS):
        del edf_index  # each run starts with none of the last one's memory held
        seconds, edf_index = _timed_build(build_blend_index, weights, num_samples)
        edf_times.append(seconds)
    edf_seconds = statistics.median(edf_times)
    edf_deviation = _deviations(edf_index, weights)
    del edf_index

    probe_samples = min(GREEDY_PROBE_SAMPLES, num_samples)
    probe_seconds, greedy_index = _timed_build(greedy_blend_index, weights, probe_samples)
    predicted = probe_seconds * num_samples / probe_samples
    extrapolated = probe_samples < num_samples and predicted >= GREEDY_FULL_RUN_LIMIT_S
    if extrapolated:
        greedy_seconds, greedy_samples = predicted, probe_samples
    elif probe_samples < num_samples:
        del greedy_index
        greedy_seconds, greedy_index = _timed_build(greedy_blend_index, weights, num_samples)
        greedy_samples = num_samples
    else:
        greedy_seconds, greedy_samples = probe_seconds, num_samples
    greedy_deviation = _deviations(greedy_index, weights)
    del greedy_index

    results = {
        "num_samples": num_samples,
        "num_corpora": num_corpora,
        "weights": f"Dirichlet(1), seed {SEED}",
        "edf_seconds": edf_seconds,
        "edf_seconds_each": edf_times,
        "greedy_seconds": greedy_seconds,
        "greedy_seconds_at_probe": probe_seconds,
        "greedy_probe_samples": probe_samples,
        "greedy_extrapolated": extrapolated,
        "speedup": greedy_seconds / edf_seconds,
        "edf_peak_bytes_per_sample": _peak_bytes_per_sample(num_samples, num_corpora),
        "max_batch_deviation": {
            "edf": edf_deviation,
            "greedy": greedy_deviation,
            "greedy_measured_on_samples": greedy_samples,
        },
    }
    _print_table(results)
    return results


def _timed_build(
    build: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]],
    weights: np.ndarray,
    num_samples: int,
) -> tuple[float, np.ndarray]:
    """Seconds for one build, and its corpus ids; the 800 MB sample index is dropped at once."""
    start = time.perf_counter()
    corpus_index, _ = build(weights, num_samples)
    return time.perf_counter() - start, corpus_index


def _weights(num_corpora: int) -> np.ndarray:
    return np.random.default_rng(SEED).dirichlet(np.ones(num_corpora))


def _deviations(corpus_index: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    """Worst |count - w * B| over every aligned batch and corpus, per batch size B."""
    return {
        str(batch_size): float(max_batch_deviation(corpus_index, weights, batch_size).max())
        for batch_size in BATCH_SIZES
    }


def _peak_bytes_per_sample(num_samples: int, num_corpora: int) -> float:
    """Peak RSS growth of one EDF build, per sample, in a fresh process (nothing else resident)."""
    code = (
        "from benchmarks.bench_blend import _measure_peak; "
        f"_measure_peak({num_samples}, {num_corpora})"
    )
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    extra_bytes = json.loads(child.stdout.strip().splitlines()[-1])["extra_bytes"]
    return extra_bytes / max(num_samples, 1)


def _measure_peak(num_samples: int, num_corpora: int) -> None:
    """Child side of ``_peak_bytes_per_sample``: prints {"extra_bytes": ...} as JSON."""
    weights = _weights(num_corpora)
    build_blend_index(weights, 1000)  # load the library and warm numpy before the baseline
    before = _resident_bytes()
    outputs = build_blend_index(weights, num_samples)
    extra = process_peak_bytes() - before
    del outputs
    print(json.dumps({"extra_bytes": extra}))


def _resident_bytes() -> int:
    return 1024 * status_kib("VmRSS") or process_peak_bytes()


def _print_table(results: dict[str, Any]) -> None:
    deviation = results["max_batch_deviation"]
    batch_sizes = list(deviation["edf"])
    print(
        f"blend interleave: N={results['num_samples']:,} samples, D={results['num_corpora']}"
        f" corpora, {results['weights']}"
    )
    header = f"{'':<20}{'time (s)':>10}" + "".join(f"{'dev@' + b:>10}" for b in batch_sizes)
    print(header)
    for name, label in (("edf", "EDF (ours)"), ("greedy", "greedy (baseline)")):
        seconds = results[f"{name}_seconds"]
        cells = "".join(f"{deviation[name][b]:>10.3f}" for b in batch_sizes)
        print(f"{label:<20}{seconds:>10.2f}{cells}")
    print(
        f"speed-up {results['speedup']:.1f}x; EDF peak memory"
        f" {results['edf_peak_bytes_per_sample']:.2f} bytes/sample;"
        f" EDF runs {', '.join(f'{t:.2f}' for t in results['edf_seconds_each'])} s"
    )
    probe = results["greedy_probe_samples"]
    if results["greedy_extrapolated"]:
        print(
            f"greedy time EXTRAPOLATED linearly from {results['greedy_seconds_at_probe']:.2f} s"
            f" at N={probe:,}; its deviations are from that N={probe:,} run"
        )
    elif probe < results["num_samples"]:
        print(
            f"greedy: {results['greedy_seconds_at_probe']:.2f} s at N={probe:,}, then one full run"
        )
