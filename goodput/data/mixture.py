"""The mixture report of a blend: target against achieved, per corpus and per stage.

Owns ``mixture_reports`` (what ``blend.json`` records under ``report`` and each stage's
``report``) and ``format_report`` (the table ``goodput data blend`` prints). A stage's rows are
its own corpora: target share, achieved share over the stage's span, worst deviation over
full batches aligned to the stage's start, samples drawn, the corpus's cursor at the stage's
start (``first_sample``), its epochs by the stage's end and whether the stage reads any of it
again (``wrapped``: past its first epoch). The blend's rows are every corpus over the whole run:
the target is the stages' targets weighed by their spans, so a one-stage blend's report is the
unstaged one's.

It does not build the index (``stages``, ``blend``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from goodput.data.interleave import max_batch_deviation
from goodput.data.manifest import corpus_names
from goodput.data.stages import count_corpora, stage_spans


def mixture_reports(
    manifest: dict[str, Any], corpus_index: np.ndarray, batch_size: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the blend's report, each stage's report) of the index ``corpus_index``."""
    names = corpus_names(manifest)
    number = {name: c for c, name in enumerate(names)}
    available = np.zeros(len(names), np.int64)
    for shard in manifest["shards"]:
        available[number[shard["corpus"]]] += shard["num_samples"]
    trainable = available - manifest.get("holdout_samples", 0)
    num_samples = len(corpus_index)
    cursor = np.zeros(len(names), np.int64)
    targets, worst = np.zeros(len(names)), np.zeros(len(names))
    stage_reports = []
    spans = stage_spans([stage["start_sample"] for stage in manifest["stages"]], num_samples)
    for stage, (start, stop) in zip(manifest["stages"], spans, strict=True):
        present = [number[name] for name, _ in stage["weights"]]
        weights = np.array([weight for _, weight in stage["weights"]])
        segment = corpus_index[start:stop]
        deviation = max_batch_deviation(segment, weights, batch_size, _lookup(present, names))
        counts = count_corpora(segment, len(names))
        rows = [
            _stage_row(
                names[c], weight, worst_batch, stop - start, counts[c], cursor[c], trainable[c]
            )
            for c, weight, worst_batch in zip(present, weights, deviation, strict=True)
        ]
        for c, weight, worst_batch in zip(present, weights, deviation, strict=True):
            targets[c] += weight * ((stop - start) / num_samples)
            worst[c] = max(worst[c], worst_batch)
        cursor += counts
        stage_reports.append({"batch_size": batch_size, "corpora": rows})
    report = _blend_report(manifest, names, targets, worst, cursor, available, batch_size)
    return report, stage_reports


def _stage_row(
    name: str, weight: float, worst_batch: float, span: int, count: int, first: int, trainable: int
) -> dict[str, Any]:
    """One corpus in a stage of ``span`` samples: ``count`` of them, its running number going
    from ``first``."""
    first, count = int(first), int(count)
    reached = first + count
    return {
        "name": name,
        "target": float(weight),
        "achieved": count / span,
        "worst_batch_deviation": float(worst_batch),
        "samples": int(count),
        "first_sample": first,
        "epochs": _epochs(reached, int(trainable)),
        "wrapped": bool(count) and reached > int(trainable),
    }


def _lookup(present: list[int], names: list[str]) -> np.ndarray | None:
    """Blend corpus id -> position in the stage's weights (-1: not in it); None for identity."""
    if present == list(range(len(names))):
        return None
    lookup = np.full(len(names), -1, np.int64)
    lookup[present] = np.arange(len(present))
    return lookup


def _epochs(samples: int, trainable: int) -> float:
    return samples / trainable if trainable > 0 else math.inf


def _blend_report(
    manifest: dict[str, Any],
    names: list[str],
    targets: np.ndarray,
    worst: np.ndarray,
    needed: np.ndarray,
    available: np.ndarray,
    batch_size: int,
) -> dict[str, Any]:
    """Per corpus over the run: target and achieved share, worst aligned-batch deviation of any
    stage, epochs."""
    heldout = manifest.get("holdout_samples", 0)
    num_samples = int(needed.sum())
    rows = []
    for c, name in enumerate(names):
        rows.append(
            {
                "corpus": name,
                "target": float(targets[c]),
                "achieved": float(needed[c] / num_samples),
                "worst_batch_deviation": float(worst[c]),
                "samples": int(needed[c]),
                "available": int(available[c]),
                "heldout": heldout,
                "epochs": _epochs(int(needed[c]), int(available[c]) - heldout),
                "files": sum(1 for s in manifest["shards"] if s["corpus"] == name),
            }
        )
    return {"batch_size": batch_size, "corpora": rows}


def format_report(blend_dir: Path, manifest: dict[str, Any]) -> str:
    """The mixture report as a table, with a loud line for every repeated corpus; a blend of
    several stages adds each stage's table and a line where a corpus wraps."""
    report = manifest["report"]
    lines = [
        f"blend {blend_dir}",
        f"  {manifest['num_samples']:,} samples of {manifest['seq_len'] + 1} tokens, "
        f"seed {manifest['seed']}, fingerprint {manifest['fingerprint'][:16]}"
        + (
            f", {manifest['holdout_samples']:,} held out per corpus"
            if "holdout_samples" in manifest
            else ""
        ),
        f"  {'corpus':<20} {'target':>8} {'achieved':>9} "
        f"{'worst dev/batch':>16} {'epochs':>8} {'files':>6}",
        f"  {'':<20} {'':>8} {'':>9} {'(B=' + str(report['batch_size']) + ')':>16}",
    ]
    for row in report["corpora"]:
        lines.append(
            f"  {row['corpus']:<20} {row['target']:>8.4f} {row['achieved']:>9.4f} "
            f"{row['worst_batch_deviation']:>16.2f} {row['epochs']:>8.3f} "
            f"{row['files']:>6}"
        )
    for row in report["corpora"]:
        if row["epochs"] > 1:
            lines.append(
                f"WARNING: corpus '{row['corpus']}' is REPEATED: {row['epochs']:.2f} "
                f"epochs ({row['samples']:,} samples from {row['available']:,})"
            )
    if len(manifest["stages"]) > 1:
        lines += _format_stages(manifest)
    return "\n".join(lines)


def _format_stages(manifest: dict[str, Any]) -> list[str]:
    lines = []
    wrapped_before: set[str] = set()
    for k, stage in enumerate(manifest["stages"]):
        lines.append(
            f"stage {k} from sample {stage['start_sample']:,} ({stage['file_list']})"
            f"\n  {'corpus':<20} {'target':>8} {'achieved':>9} {'worst dev/batch':>16} "
            f"{'from':>12} {'epochs':>8}"
        )
        for row in stage["report"]["corpora"]:
            lines.append(
                f"  {row['name']:<20} {row['target']:>8.4f} {row['achieved']:>9.4f} "
                f"{row['worst_batch_deviation']:>16.2f} {row['first_sample']:>12,} "
                f"{row['epochs']:>8.3f}"
            )
        for row in stage["report"]["corpora"]:
            if row["wrapped"] and row["name"] not in wrapped_before:
                wrapped_before.add(row["name"])
                lines.append(
                    f"WARNING: corpus '{row['name']}' wraps in stage {k}: it has been read "
                    f"whole, and repeats in a fresh shuffle ({row['epochs']:.2f} epochs by "
                    "the stage's end)"
                )
    return lines
