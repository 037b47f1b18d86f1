"""``goodput eval``'s model against lm-eval's own ``hf`` model: log-likelihood requests per second
through lm-eval's evaluator, the same task, checkpoint and machine.

Ours: ``GoodputLM`` (the goodput ``Transformer`` loaded from the checkpoint, harness scoring).
Baseline: lm-eval's ``HFLM`` on the ``goodput ckpt export-hf`` folder of the same checkpoint
(``LlamaForCausalLM``, fp32, CPU, ``prefix_token_id`` the end-of-document id, as the agreement
test runs it). Both run the same ``lm_eval_tasks.run_tasks`` call on the same local ARC-like task
(``NUM_ITEMS`` items, some past ``max_seq_len`` and cut from the left), batch size
``BATCH_SIZE``, one process, both cores.

Two models: ``tiny`` (the tests' 2-layer dim-32 model, 64 positions: per-request overhead
dominates) and ``small`` (dim 256, 4 layers, 128 positions: the forward counts). Both are trained
``TRAIN_STEPS`` steps on the tiny tokenized corpus (only the arithmetic matters here).

Figures: ``requests_per_s`` is the requests over the time inside the model's ``loglikelihood``
(lm-eval's request building and metrics are the same code for both and are left out);
``evaluator_s`` the whole ``run_tasks`` call. Median of ``REPEATS`` repeats after one warm-up,
the two sides back to back in each (order reversed on odd repeats). Ratio = ours / hf
requests per second (target >= 1).
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from goodput import cli
from goodput.eval.lm_eval_tasks import (
    OFFLINE_VARIABLES,
    load_tasks,
    require_lm_eval,
    resolve_tasks,
    run_tasks,
)
from goodput.testing.eval_tasks import write_choice_task
from goodput.testing.tiny import tokenized_run_config
from goodput.train.loop import train

NUM_ITEMS = 120
BATCH_SIZE = 16
REPEATS = 5
TRAIN_STEPS = 2
SIZES = {
    "tiny": {},
    "small": {
        "dim": 256,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "ffn_dim": 768,
        "max_seq_len": 128,
    },
}


def _checkpoint(root: Path, size: dict[str, Any]) -> tuple[Path, Path]:
    """A trained checkpoint of the size and its HF export."""
    root.mkdir()
    cfg, _ = tokenized_run_config(root)
    cfg = replace(
        cfg,
        model=replace(cfg.model, **size),
        train=replace(cfg.train, steps=TRAIN_STEPS, tensorboard=False),
        checkpoint=replace(cfg.checkpoint, interval_steps=TRAIN_STEPS, async_save=False),
    )
    with contextlib.redirect_stdout(io.StringIO()):
        train(cfg)
        step = root / "tiny" / "run" / "checkpoints" / f"step-{TRAIN_STEPS:08d}"
        assert cli.main(["ckpt", "export-hf", str(step), str(root / "hf")]) == 0
    return step, root / "hf"


class _Timed:
    """Wraps an LM's ``loglikelihood``: the time inside it and the requests it answered."""

    def __init__(self, lm: Any):
        self.seconds, self.requests = 0.0, 0
        inner = lm.loglikelihood

        def loglikelihood(requests: list[Any], *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = inner(requests, *args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.requests += len(requests)
            return result

        lm.loglikelihood = loglikelihood


def _run(lm: Any, task_file: Path) -> dict[str, float]:
    loaded = load_tasks(resolve_tasks([str(task_file)]))
    timed = _Timed(lm)
    start = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):
        results = run_tasks(lm, loaded)
    evaluator_s = time.perf_counter() - start
    del lm.loglikelihood  # back to the class's own
    assert results is not None
    return {
        "requests": timed.requests,
        "requests_per_s": timed.requests / timed.seconds,
        "evaluator_s": evaluator_s,
        "acc": results["results"][next(iter(results["results"]))]["acc,none"],
    }


def _compare(step: Path, hf: Path, task_file: Path) -> dict[str, Any]:
    from lm_eval.models.huggingface import HFLM

    from goodput.eval.lm_eval_model import GoodputLM

    ours = GoodputLM.from_checkpoint(step, None, batch_size=BATCH_SIZE)
    eod_id = ours.tokenizer.eod_id
    with contextlib.redirect_stderr(io.StringIO()):
        theirs = HFLM(
            pretrained=str(hf),
            dtype="float32",
            device="cpu",
            batch_size=BATCH_SIZE,
            prefix_token_id=eod_id,
        )
    sides = {"goodput": ours, "hf": theirs}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for index in range(REPEATS + 1):
        order = list(sides) if index % 2 == 0 else list(reversed(sides))
        for name in order:
            figures = _run(sides[name], task_file)
            if index > 0:  # the first is a warm-up
                runs[name].append(figures)
    assert runs["goodput"][0]["acc"] == runs["hf"][0]["acc"], "the two must score alike"
    result: dict[str, Any] = {"requests": runs["goodput"][0]["requests"]}
    for name, figures in runs.items():
        for key in ("requests_per_s", "evaluator_s"):
            result[f"{name}_{key}"] = statistics.median(f[key] for f in figures)
    result["ratio"] = result["goodput_requests_per_s"] / result["hf_requests_per_s"]
    return result


def main() -> dict[str, Any]:
    for variable in OFFLINE_VARIABLES:
        os.environ.setdefault(variable, "1")
    require_lm_eval()
    torch.set_num_threads(2)
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        task_file = write_choice_task(root / "tasks", num_items=NUM_ITEMS)
        for name, size in SIZES.items():
            step, hf = _checkpoint(root / name, size)
            figures[name] = _compare(step, hf, task_file)
    print(f"eval: log-likelihood requests/s through lm-eval's evaluator, median of {REPEATS}")
    for name, row in figures.items():
        print(
            f"  {name:6s} {row['requests']} requests: goodput {row['goodput_requests_per_s']:8.0f}"
            f"/s, hf {row['hf_requests_per_s']:8.0f}/s: {row['ratio']:.2f}x (evaluator "
            f"{row['goodput_evaluator_s']:.2f} s vs {row['hf_evaluator_s']:.2f} s)"
        )
    return figures
