"""In-memory checkpoints (snapshots): what a step pays for one, against what it pays for an async
disk save, and what snapshots every step or every 5 cost a run against a run without them.

Model: ``bench_checkpoint``'s 105.8M-parameter ``Transformer`` (fp32, AdamW: 1.27 GB of state,
0.63 GB a rank), trained by the real ``python -m goodput train`` on 2 ranks started by hand as
``goodput launch`` would start them on two hosts (``goodput.testing.ranks``: one rank per
emulated host, ``launched_on(..., ["n1", "n2"])``), so every snapshot also goes to the partner on
the other "host" (gloo over loopback TCP here). Snapshots live in ``/dev/shm``. ``STEPS`` steps
of 4 samples x 16 tokens (~1 s a step on this machine, almost all of it the optimizer), so that
the state, not compute, dominates what is measured.

Four variants, ``REPEATS`` rounds of each, in an order rotated every round:

  - ``none``: no snapshots, no disk saves: the baseline step time;
  - ``async_save``: an async disk save every ``INTERVAL`` steps: its hold (``checkpoint_stall_s``
    of the step after each save: the state dict, the small files, the copy to host memory);
  - ``k5`` and ``k1``: ``checkpoint.memory_interval_steps`` 5 and 1, no disk saves: the
    snapshot's hold (``snapshot_stall_s``: the copy into the mapped slot, plus any wait at the
    next vote for the background checksums and partner copy to finish).

Figures, medians over every step of every round but each process's first (its start-up): the
step time of each variant (``step_time_s`` includes the holds), the async save's hold, the
snapshot's hold at k = 5 (the background has 5 steps to finish: the copy alone) and at k = 1
(copy and settling wait), and the ratios: snapshot hold / async save hold (target <= 1.1: a
snapshot stalls a step no longer than today's async save) and step time with snapshots / without.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_checkpoint import MODEL
from goodput import rundir
from goodput.checkpoint.config import CheckpointConfig
from goodput.config import to_toml
from goodput.testing.jobs import outside_any_job
from goodput.testing.ranks import launched_on, start_ranks
from goodput.testing.tiny import tiny_run_config
from goodput.train.flops import model_size

NUM_RANKS = 2
HOSTS = ("n1", "n2")
SEQ_LEN = 16
BATCH = 4  # samples a step: 2 a rank
STEPS = 16
INTERVAL = 4  # the async_save variant's disk interval: its flush (~4 s) ends before the next
REPEATS = 3
TIMEOUT_S = 900
VARIANTS = {
    "none": CheckpointConfig(),
    "async_save": CheckpointConfig(interval_steps=INTERVAL, keep_last=1),
    "k5": CheckpointConfig(memory_interval_steps=5),
    "k1": CheckpointConfig(memory_interval_steps=1),
}


def _run(root: Path, name: str, repeat: int) -> list[dict[str, Any]]:
    """One run of variant ``name``: its step records but the first."""
    folder = root / f"{name}-{repeat}"
    folder.mkdir()
    cfg = tiny_run_config(folder)
    cfg = dataclasses.replace(
        cfg,
        model=MODEL,
        train=dataclasses.replace(
            cfg.train, steps=STEPS, tokens_per_step=BATCH * SEQ_LEN, seq_len=SEQ_LEN
        ),
        checkpoint=VARIANTS[name],
    )
    config = root / f"{name}-{repeat}.toml"
    config.write_text(to_toml(cfg))
    ranks = start_ranks(config, outside_any_job() | launched_on(folder, HOSTS))
    outputs = [process.communicate(timeout=TIMEOUT_S) for process in ranks]
    if any(process.returncode != 0 for process in ranks):
        raise SystemExit(f"bench_snapshot: {name} failed:\n" + "\n".join(map(str, outputs)))
    metrics = Path(cfg.train.run_dir) / rundir.METRICS
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return records[1:]


def _median(records: list[dict[str, Any]], key: str, *, nonzero: bool = False) -> float:
    values = [r.get(key) or 0.0 for r in records]
    return statistics.median([v for v in values if v > 0] if nonzero else values)


def main() -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory(prefix="goodput-bench-snapshot-") as tmp:
        for repeat in range(REPEATS):
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for name in order:
                runs[name] += _run(Path(tmp), name, repeat)
    step_s = {name: _median(records, "step_time_s") for name, records in runs.items()}
    save_hold = _median(runs["async_save"], "checkpoint_stall_s", nonzero=True)
    hold_k5 = _median(runs["k5"], "snapshot_stall_s", nonzero=True)
    figures = {
        "model_parameters": model_size(MODEL).total,
        "ranks": NUM_RANKS,
        "step_s": step_s,
        "async_save_hold_s": save_hold,
        "snapshot_hold_k5_s": hold_k5,
        "snapshot_hold_k1_s": _median(runs["k1"], "snapshot_stall_s"),
        "snapshot_over_async_save": hold_k5 / save_hold,
        "snapshot_over_async_save_target": 1.1,
        "step_k1_over_none": step_s["k1"] / step_s["none"],
        "step_k5_over_none": step_s["k5"] / step_s["none"],
    }
    print(
        f"snapshot: hold {hold_k5:.3f} s (k=5) vs async save hold {save_hold:.3f} s: "
        f"{figures['snapshot_over_async_save']:.2f}x (target <= 1.1); k=1 hold "
        f"{figures['snapshot_hold_k1_s']:.3f} s (copy + settling); median step "
        + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in step_s.items())
        + f"; k=1 / none {figures['step_k1_over_none']:.3f}, k=5 / none "
        f"{figures['step_k5_over_none']:.3f}"
    )
    return figures
