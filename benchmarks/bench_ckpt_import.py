"""``goodput ckpt import`` of a 1B-parameter Megatron checkpoint, against reading the same bytes.

Source: a Megatron-core GPTModel of 1.07B parameters (vocab 32,000, dim 2,048, 20 layers, 16
heads in 8 query groups, SwiGLU ffn 5,632, untied head), its weights in bf16 as Megatron-LM
keeps them, built and saved by Megatron-core itself (``goodput.testing.megatron_source``, one
rank) in both formats goodput reads from it: ``torch_dist`` (Megatron-core's DCP folder) and the
legacy ``model_optim_rng.pt`` (one pickle). DeepSpeed's ``model_states.pt`` goes through the
legacy path's joiner and is not measured apart.

Per format, ``REPEATS`` times, in turn: the source's files are dropped from the page cache
(``posix_fadvise(DONTNEED)``), then ``python -m goodput ckpt import SRC --from ... --config
MODEL.toml --output OUT`` runs as a subprocess (wall time from ``Popen`` to exit, and its peak
RSS); the files are dropped again and read whole in 16 MiB blocks (baseline: the time to read the
same bytes); then read again and as many bytes as the import wrote written to a new file and
fsync'd (a second baseline: the floor of any converter that reads the source and writes an
fp32 checkpoint). Import GB/s and read GB/s are the source's bytes over each median; the ratios
are the import's time over each baseline's. What the import does beyond reading: interpreter
and imports, the args check, the fused tensors split, the RoPE permutation, the upcast to fp32,
writing the fp32 checkpoint (twice the source's bytes) with fsync, and hashing it for
``checksums.json`` as it is written.
Peak RSS against the fp32 model's size shows the import holds one tensor, not the model.
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

from benchmarks.bench_checkpoint import _drop_from_page_cache, _each_file, _read_into_page_cache
from goodput.config import load_section
from goodput.launch.launchers import free_port
from goodput.testing import megatron_source
from goodput.train.config.model import ModelConfig
from goodput.train.flops import model_size

REPEATS = 3
SPEC = {
    "num_layers": 20,
    "hidden_size": 2048,
    "ffn_hidden_size": 5632,
    "num_attention_heads": 16,
    "num_query_groups": 8,
    "max_position_embeddings": 2048,
    "rotary_base": 10000.0,
    "norm_epsilon": 1e-5,
    "vocab_size": 32000,
    "tied": False,
    "params_dtype": "bfloat16",
}
FORMATS = {"torch_dist": "megatron", "legacy": "megatron-legacy"}


def _size(directory: Path) -> int:
    return sum(path.stat().st_size for path in _each_file(directory))


def _read(directory: Path) -> float:
    _drop_from_page_cache(directory)
    start = time.perf_counter()
    _read_into_page_cache(directory)
    return time.perf_counter() - start


def _write(path: Path, size: int) -> float:
    """Seconds to write ``size`` bytes to a new file and fsync it: the output's floor."""
    block = bytes(1 << 24)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, size, len(block)):
            f.write(block[: min(len(block), size - offset)])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


# The CLI in a process of its own that reports its own peak RSS (kB) as its last line.
_MEASURED_CLI = (
    "import resource, sys; from goodput.cli import main; code = main(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)"
)


def _import(source: Path, kind: str, config: Path, out: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (GB) of one import, the source cold."""
    _drop_from_page_cache(source)
    shutil.rmtree(out, ignore_errors=True)
    argv = ["ckpt", "import", str(source), "--from", kind, "--config", str(config)]
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", _MEASURED_CLI, *argv, "--output", str(out)],
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if result.returncode:
        raise RuntimeError(f"import failed: {result.stderr[-2000:]}")
    return seconds, int(result.stdout.split()[-1]) / 1e6


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-import-") as tmp:
        root = Path(tmp)
        (root / "spec.json").write_text(json.dumps(SPEC))
        print("benchmark ckpt: Megatron-core builds and saves the 1.07B source", flush=True)
        start = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                megatron_source.__file__,
                "save",
                str(root / "spec.json"),
                str(root / "source"),
                "--formats",
                "torch_dist,legacy",
                "--port",
                str(free_port()),
            ],
            check=True,
            capture_output=True,
        )
        saved_s = time.perf_counter() - start
        config = root / "model.toml"
        config.write_text(megatron_source.model_toml(SPEC))
        parameters = model_size(load_section(ModelConfig, config, "model")).total
        results: dict[str, Any] = {
            "parameters": parameters,
            "source_dtype": SPEC["params_dtype"],
            "megatron_save_s": round(saved_s, 1),
            "repeats": REPEATS,
        }
        for fmt, kind in FORMATS.items():
            source = root / "source" / fmt
            size = _size(source)
            imports, reads, copies, peaks = [], [], [], []
            for _ in range(REPEATS):
                seconds, peak = _import(source, kind, config, root / "out")
                imports.append(seconds)
                peaks.append(peak)
                written = _size(root / "out")
                shutil.rmtree(root / "out")
                reads.append(_read(source))
                copies.append(_read(source) + _write(root / "floor.bin", written))
            import_s, read_s = statistics.median(imports), statistics.median(reads)
            copy_s = statistics.median(copies)
            results[kind] = {
                "source_gb": round(size / 1e9, 3),
                "written_gb": round(written / 1e9, 3),
                "import_s": round(import_s, 2),
                "read_s": round(read_s, 2),
                "import_gbps": round(size / 1e9 / import_s, 3),
                "read_gbps": round(size / 1e9 / read_s, 3),
                "import_over_read": round(import_s / read_s, 1),
                "read_and_write_s": round(copy_s, 2),
                "import_over_read_and_write": round(import_s / copy_s, 2),
                "peak_rss_gb": round(max(peaks), 2),
                "model_fp32_gb": round(4 * parameters / 1e9, 2),
                "import_runs_s": [round(s, 2) for s in imports],
            }
            print(f"benchmark ckpt: {kind}: {results[kind]}", flush=True)
    return results
