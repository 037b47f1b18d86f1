"""Blend by weight: file lists of ``weight path-prefix corpus`` lines -> a memory-mapped index.

A blend is one or more data-mix stages (``stages``): each a file list, from a global sample on;
a plain blend is one stage from sample 0. The file lists are read by ``sources`` (one set of
shards across stages), the stages interleaved by ``stages``, the mixture reported by
``mixture``. Three levels, each cached by what it depends on and nothing more:

* **file** (``files/<sha256>-seed<S>/``): the file's documents in a seeded order and their
  start offsets in that order's token stream. Sample ``s`` of the file is tokens
  ``[s·L, s·L + L + 1)`` of that stream (packed across documents, one token of overlap so the
  last label is the next sample's first input). Depends only on (checksum, seed): a weight,
  seq_len or run-length change never rebuilds it. Packed shards (``--pack-seq-len``) need none:
  row ``s`` is sample ``s``. Its ``sha256.json`` lets a later blend reuse it only intact.
* **corpus**: all samples of a corpus's files in one seeded permutation per epoch, so files are
  mixed in proportion to their token counts. Only the prefix the run needs is stored; a longer
  run's extends it. With ``holdout_samples = h`` (``[eval] holdout_samples``), ``h`` samples of
  every corpus, drawn by a seed of their own (``heldout_samples``), are left out of every epoch
  and saved as ``heldout_NNNN.npy``: the in-loop eval's held-out set, never a training sample.
  Samples are windows of the shuffled document stream, so a held-out window shares its edge
  documents (and one token) with its training neighbours; whole documents are not held out.
* **blend** (``stages.interleave_stages``): for every global sample, its corpus and its running
  number in that corpus (carried across stages), each stage interleaved so that every prefix of
  it — hence every global batch — is within one sample of ``weight × n`` for each corpus.

A blend directory ``blends/<fingerprint>/`` is built in a temp directory and renamed into place
with ``.complete`` inside, so readers never see half an index; ``blend.json`` in it is the run
manifest (see ``manifest``), and records the sha256 of every index array the blend reads
(``index_sha256``, see ``index_files``). A cache hit is checked as the loader checks a blend:
arrays and checksums. A blend built before checksums were recorded is refused with the fix
(delete it; the rebuild has the same fingerprint and the same samples). Building the file
indices and the corpus orders shows progress on stderr (``goodput.progress``); a cache hit
prints its one line.

Per-file lines' weights add up to their corpus's weight; inside a corpus, files are mixed by token
count. A shard is listed once: two lines reaching one file (``file_list``) or the same bytes (one
checksum) are refused, naming both lines.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from goodput import __version__
from goodput.data.file_list import FileListEntry, parse_file_list
from goodput.data.index_files import (
    SHARD_INDEX_SHA256,
    IndexFile,
    corpus_order_name,
    heldout_name,
    index_files,
    reuse_shard_index,
    save_array,
    shard_index_files,
)
from goodput.data.interleave import MAX_SAMPLES, build_blend_index
from goodput.data.manifest import corpus_names, fingerprint, git_sha, open_blend
from goodput.data.mixture import format_report, mixture_reports
from goodput.data.schema import RUN_FORMAT
from goodput.data.shards import ShardReader
from goodput.data.sources import StageSource, blend_entries, describe_shards, read_stages
from goodput.data.stages import BlendStage, check_stages, interleave_stages
from goodput.errors import GoodputError
from goodput.io import fsync_dir, is_complete, sha256_file, write_json, write_marker
from goodput.outputs import DATA_DIR, check_output_dir
from goodput.progress import Progress

__all__ = [
    "build_blend_index",
    "parse_file_list",
    "BlendSpec",
    "BlendStage",
    "build_blend",
    "format_report",
    "FileListEntry",
]

ON_EXHAUSTED = ("repeat", "error")
MAX_HELDOUT = 1 << 20  # held-out samples per corpus: an eval set, not a second corpus
HELDOUT_STREAM = 1 << 62  # the held-out draw's seed word, beyond any epoch number


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendSpec:
    stages: tuple[BlendStage, ...]  # a plain blend: (BlendStage(file_list, 0),)
    seq_len: int
    num_samples: int
    seed: int
    cache: Path  # the blend cache ([data] cache): blends/ and the per-shard file indices
    on_exhausted: str = "repeat"
    report_batch_size: int = 256
    holdout_samples: int = 0  # per corpus, left out of training for evaluation
    step_samples: int = 1  # the global batch: a stage starts on a step's first sample


def build_blend(spec: BlendSpec) -> tuple[Path, dict[str, Any]]:
    """Build (or find in the cache) the blend of ``spec``; return its directory and manifest."""
    _check_spec(spec)
    check_output_dir(spec.cache, DATA_DIR, "--cache")
    sources = read_stages(spec.stages)
    shards, tokenizer = describe_shards(blend_entries(sources), spec.seq_len)
    pinned: dict[str, Any] = {
        "format": RUN_FORMAT,
        "tokenizer": tokenizer,
        "shards": shards,
        "weights": sources[0].weights,
        "seed": spec.seed,
        "seq_len": spec.seq_len,
        "num_samples": spec.num_samples,
        "on_exhausted": spec.on_exhausted,
    }
    if spec.holdout_samples:  # absent when 0: a blend without one keeps its fingerprint
        pinned["holdout_samples"] = spec.holdout_samples
    pinned["stages"] = [_stage_record(source) for source in sources]
    blend_fingerprint, components = fingerprint(pinned)
    final = blend_dir(spec.cache, blend_fingerprint)
    if is_complete(final):
        print(f"blend: cached at {final}", file=sys.stderr)
        _build_file_indices(shards, spec)  # only those deleted since: they rebuild identical
        return final, cached_manifest(final, spec.report_batch_size)
    manifest = {
        **pinned,
        "fingerprint": blend_fingerprint,
        "components": components,
        "goodput_version": __version__,
        "git_sha": git_sha(),
    }
    return final, _build_into(final, manifest, spec)


def _check_spec(spec: BlendSpec) -> None:
    if min(spec.seq_len, spec.num_samples, spec.report_batch_size, spec.step_samples) < 1:
        raise GoodputError.usage(
            "blend",
            "--seq-len, --num-samples, --report-batch-size and --step-samples must be positive",
            "pass positive values",
        )
    if spec.on_exhausted not in ON_EXHAUSTED:
        raise GoodputError.usage(
            "blend",
            f"--on-exhausted {spec.on_exhausted!r} is not valid",
            f"use one of {', '.join(ON_EXHAUSTED)}",
        )
    if spec.num_samples > MAX_SAMPLES:
        raise GoodputError.usage(
            "--num-samples", f"{spec.num_samples:,} is above {MAX_SAMPLES:,}", "pass fewer"
        )
    if not 0 <= spec.holdout_samples <= MAX_HELDOUT:
        raise GoodputError.usage(
            "holdout samples",
            f"{spec.holdout_samples:,} is not in [0, {MAX_HELDOUT:,}]",
            "hold out fewer samples per corpus",
        )
    check_stages(spec.stages, spec.num_samples, spec.step_samples)


def _stage_record(source: StageSource) -> dict[str, Any]:
    """What ``blend.json`` records of a stage before its report is added."""
    return {
        "start_sample": source.stage.start_sample,
        "file_list": str(source.stage.file_list),
        "file_list_sha256": source.sha256,
        "weights": source.weights,
    }


def _build_into(final: Path, pinned: dict[str, Any], spec: BlendSpec) -> dict[str, Any]:
    """Write every index of the blend and its manifest (returned) into a temp dir, then rename
    it to ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _build_file_indices(pinned["shards"], spec)
        corpus_index, sample_index = interleave_stages(
            _stage_weights(pinned), [stage.start_sample for stage in spec.stages], spec.num_samples
        )
        report, stage_reports = mixture_reports(pinned, corpus_index, spec.report_batch_size)
        rows = report["corpora"]
        heldouts = [
            heldout_samples(row["corpus"], row["available"], row["heldout"], spec.seed)
            for row in rows
        ]
        _refuse_exhausted(stage_reports, report, spec)
        _print_wraps(stage_reports, spec)
        save_array(tmp / "corpus_index.npy", corpus_index)
        save_array(tmp / "sample_index.npy", sample_index)
        del corpus_index, sample_index  # saved: the corpus orders below need the memory
        _save_corpus_orders(tmp, rows, heldouts, spec.seed)
        stages = [
            {**stage, "report": stage_report}
            for stage, stage_report in zip(pinned["stages"], stage_reports, strict=True)
        ]
        manifest = {**pinned, "report": report, "stages": stages}
        files = index_files(tmp, manifest)
        manifest["index_sha256"] = {key: sha256_file(file.path) for key, file in files.items()}
        write_json(tmp / "blend.json", manifest)
        write_marker(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not is_complete(final):
                raise
            shutil.rmtree(tmp)  # a concurrent build of the same fingerprint won: same content
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _stage_weights(pinned: dict[str, Any]) -> np.ndarray:
    """``[stage, corpus]`` weights over the blend's corpora (0 where a stage omits one)."""
    number = {name: c for c, name in enumerate(corpus_names(pinned))}
    weights = np.zeros((len(pinned["stages"]), len(number)))
    for k, stage in enumerate(pinned["stages"]):
        for name, weight in stage["weights"]:
            weights[k, number[name]] = weight
    return weights


def _save_corpus_orders(
    directory: Path, rows: list[dict[str, Any]], heldouts: list[np.ndarray], seed: int
) -> None:
    total = sum(row["samples"] for row in rows)
    with Progress("blend: corpus orders", total=total, unit="samples") as progress:
        for c, (row, heldout) in enumerate(zip(rows, heldouts, strict=True)):
            order = corpus_order(row["corpus"], row["available"], row["samples"], seed, heldout)
            save_array(directory / corpus_order_name(c), order)
            if len(heldout):
                save_array(directory / heldout_name(c), heldout)
            progress.advance(row["samples"])


def _print_wraps(stage_reports: list[dict[str, Any]], spec: BlendSpec) -> None:
    """One line on stderr for the stage where a corpus is first read past its first epoch,
    when the blend has stages (a plain blend's report says REPEATED)."""
    if len(spec.stages) < 2:
        return
    wrapped: set[str] = set()
    for k, report in enumerate(stage_reports):
        for row in report["corpora"]:
            if row["wrapped"] and row["name"] not in wrapped:
                wrapped.add(row["name"])
                print(
                    f"blend: corpus '{row['name']}' wraps in stage {k} "
                    f"({spec.stages[k].file_list}): read whole, it repeats in a fresh shuffle "
                    f"({row['epochs']:.2f} epochs by the stage's end)",
                    file=sys.stderr,
                )


def _build_file_indices(shards: list[dict[str, Any]], spec: BlendSpec) -> None:
    """The per-shard file indices the cache lacks (a packed shard needs none: row s of it is
    sample s). One found complete and intact is kept, one damaged is refused, naming the file
    (``reuse_shard_index``); progress is shown only when one is built: a cache hit stays quiet."""
    missing = []
    for shard in shards:
        if shard["packed"]:
            continue
        files = shard_index_files(
            spec.cache, shard["sha256_bin"], spec.seed, shard["num_documents"]
        )
        if not reuse_shard_index(files):
            missing.append((shard, files))
    if not missing:
        return
    with Progress("blend: file indices", total=len(missing), unit="shards") as progress:
        for shard, files in missing:
            build_file_index(shard, spec.seed, files)
            progress.advance(1, documents=shard["num_documents"])


def build_file_index(shard: dict[str, Any], seed: int, files: list[tuple[str, IndexFile]]) -> None:
    """Seeded document order of one shard and the start of each document in that order, into
    ``files`` (``shard_index_files``: shared by every blend of the shard with this seed; the
    caller has found them absent or incomplete, ``reuse_shard_index``)."""
    reader = ShardReader(shard["prefix"])
    rng = np.random.default_rng([seed, int(shard["sha256_bin"][:16], 16)])
    order = rng.permutation(len(reader)).astype(np.int64)
    starts = np.zeros(len(reader) + 1, np.int64)
    np.cumsum(reader.document_lengths[order], out=starts[1:])
    (order_name, order_file), (starts_name, starts_file) = files
    save_array(order_file.path, order)
    save_array(starts_file.path, starts)
    directory = order_file.path.parent
    write_json(
        directory / SHARD_INDEX_SHA256,
        {order_name: sha256_file(order_file.path), starts_name: sha256_file(starts_file.path)},
    )
    write_marker(directory)


def corpus_order(
    corpus: str, available: int, needed: int, seed: int, heldout: np.ndarray | None = None
) -> np.ndarray:
    """The first ``needed`` samples of a corpus: one fresh seeded permutation per epoch of the
    samples not ``heldout`` (sorted sample numbers), seeded by the epoch alone, so a larger
    ``needed`` extends a smaller one (a lengthened run's resume relies on it and checks it:
    ``goodput.data.prefix``). With nothing held out, epoch ``e`` is the permutation itself."""
    held = np.zeros(0, np.int64) if heldout is None else np.asarray(heldout, np.int64)
    pool = available - len(held)
    if needed and pool < 1:
        raise GoodputError(
            corpus,
            f"corpus has no complete sample to train on ({available:,} in all, "
            f"{len(held):,} held out)",
            "add data to it, lower --seq-len or hold out fewer samples",
        )
    dtype = np.uint32 if available <= np.iinfo(np.uint32).max else np.int64
    # The i-th training sample's number: i plus the held-out numbers at or below it
    # (held[j] - j counts the training samples before held[j]).
    gaps = held - np.arange(len(held))
    epochs = []
    for epoch in range(-(-needed // pool) if needed else 0):
        rng = np.random.default_rng([seed, _corpus_key(corpus), epoch])
        ranks = rng.permutation(pool)
        epochs.append((ranks + np.searchsorted(gaps, ranks, side="right")).astype(dtype))
    return np.concatenate(epochs)[:needed] if epochs else np.zeros(0, dtype)


def heldout_samples(corpus: str, available: int, count: int, seed: int) -> np.ndarray:
    """The ``count`` sample numbers of a corpus held out of training, sorted: drawn without
    replacement by a generator of their own (no epoch's), so they do not depend on the run's
    length."""
    if not count:
        return np.zeros(0, np.int64)
    if count >= available:
        raise GoodputError(
            corpus,
            f"corpus holds {available:,} samples; holding out {count:,} leaves none to train on",
            "hold out fewer samples per corpus ([eval] holdout_samples) or add data",
        )
    rng = np.random.default_rng([seed, _corpus_key(corpus), HELDOUT_STREAM])
    return np.sort(rng.choice(available, count, replace=False)).astype(np.int64)


def _corpus_key(corpus: str) -> int:
    return int(hashlib.sha256(corpus.encode()).hexdigest()[:16], 16)


FINGERPRINT = re.compile(r"[0-9a-f]{20,64}")


def blend_dir(cache: Path, blend_fingerprint: str) -> Path:
    """Where the blend of ``blend_fingerprint`` lives in ``cache``. A fingerprint read from
    outside (a checkpoint's train state) must be the hex goodput writes: never a path."""
    if not FINGERPRINT.fullmatch(blend_fingerprint):
        raise GoodputError(
            cache,
            f"blend fingerprint {blend_fingerprint[:80]!r} is not hex",
            "use another checkpoint",
        )
    return cache / "blends" / blend_fingerprint[:20]


def cached_manifest(directory: Path, batch_size: int) -> dict[str, Any]:
    """A built blend's manifest, checked as the loader checks it (``open_blend``), its report
    redone when asked for another batch size."""
    manifest, arrays = open_blend(directory)
    if manifest["report"]["batch_size"] != batch_size:
        report, stage_reports = mixture_reports(manifest, arrays["corpus_index.npy"], batch_size)
        manifest["report"] = report
        for stage, stage_report in zip(manifest["stages"], stage_reports, strict=True):
            stage["report"] = stage_report
    return manifest


def _refuse_exhausted(
    stage_reports: list[dict[str, Any]], report: dict[str, Any], spec: BlendSpec
) -> None:
    """With ``on_exhausted = "error"``, refuse a corpus read past its first epoch, naming the
    file list of the stage that does."""
    if spec.on_exhausted != "error":
        return
    available = {row["corpus"]: row["available"] for row in report["corpora"]}
    for stage, stage_report in zip(spec.stages, stage_reports, strict=True):
        for row in stage_report["corpora"]:
            if row["wrapped"]:
                raise GoodputError(
                    stage.file_list,
                    f"corpus '{row['name']}' needs {row['first_sample'] + row['samples']:,} "
                    f"samples but holds {available[row['name']]:,} ({row['epochs']:.2f} epochs)",
                    "lower its weight or --num-samples, add data, or pass --on-exhausted repeat",
                )
