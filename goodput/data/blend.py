"""Blend by weight: a file list of ``weight path-prefix corpus`` lines -> a memory-mapped index.

Three levels, each cached by what it depends on and nothing more:

* **file** (``files/<sha256>-seed<S>/``): the file's documents in a seeded order and their
  start offsets in that order's token stream. Sample ``s`` of the file is tokens
  ``[s·L, s·L + L + 1)`` of that stream (packed across documents, one token of overlap so the
  last label is the next sample's first input). Depends only on (checksum, seed): a weight,
  seq_len or run-length change never rebuilds it. Packed shards (``--pack-seq-len``) need none:
  row ``s`` is sample ``s``.
* **corpus**: all samples of a corpus's files in one seeded permutation per epoch, so files are
  mixed in proportion to their token counts. Only the prefix the run needs is stored.
* **blend** (``build_blend_index``): for every global sample, its corpus and its running number
  in that corpus, interleaved so that every prefix — hence every global batch — is within one
  sample of ``weight × n`` for each corpus.

A blend directory ``blends/<fingerprint>/`` is built in a temp directory and renamed into place
with ``.complete`` inside, so readers never see half an index; ``blend.json`` in it is the run
manifest (see ``manifest``). Per-file lines' weights add up to their corpus's weight; inside a
corpus, files are mixed by token count.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from goodput import __version__
from goodput.data.interleave import build_blend_index, max_batch_deviation
from goodput.data.manifest import (
    RUN_FORMAT,
    ShardIndex,
    fingerprint,
    git_sha,
    read_json,
)
from goodput.data.shards import ShardReader, bin_path, idx_path
from goodput.errors import GoodputError
from goodput.io import fsync_dir, is_complete, sha256_file, write_json, write_marker

__all__ = ["build_blend_index", "parse_file_list", "BlendSpec", "build_blend", "FileListEntry"]

ON_EXHAUSTED = ("repeat", "error")


@dataclass(frozen=True, slots=True)
class FileListEntry:
    weight: float
    prefix: Path
    corpus: str
    line: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendSpec:
    file_list: Path
    seq_len: int
    num_samples: int
    seed: int
    output: Path
    on_exhausted: str = "repeat"
    report_batch_size: int = 256


def parse_file_list(path: Path) -> list[FileListEntry]:
    """Read ``weight path-prefix corpus`` lines; ``#`` comments and blank lines are skipped.

    Relative prefixes are resolved against the file list's own directory, so a list travels
    with its data.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise GoodputError(path, "file list not found", "check the path") from None
    except UnicodeDecodeError:
        raise GoodputError(
            path, "file list is not UTF-8 text", "write lines of 'weight path-prefix corpus'"
        ) from None
    entries = []
    seen: dict[Path, int] = {}
    for number, raw in enumerate(lines, start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        entry = _parse_line(path, number, text)
        if entry.prefix in seen:
            raise GoodputError(
                f"{path}:{number}",
                f"'{entry.prefix}' is already listed on line {seen[entry.prefix]}",
                "list each file once; its weight is what sets how often it is read",
            )
        seen[entry.prefix] = number
        entries.append(entry)
    if not entries:
        raise GoodputError(
            path, "file list has no entries", "add lines of 'weight path-prefix corpus'"
        )
    return entries


def _parse_line(path: Path, number: int, text: str) -> FileListEntry:
    where = f"{path}:{number}"
    fields = text.split()
    if len(fields) != 3:
        raise GoodputError(
            where,
            f"expected 3 fields 'weight path-prefix corpus', got {len(fields)}",
            "fix the line (paths may not contain spaces)",
        )
    weight_text, prefix_text, corpus = fields
    try:
        weight = float(weight_text)
    except ValueError:
        raise GoodputError(
            where, f"weight '{weight_text}' is not a number", "write a positive number first"
        ) from None
    if not math.isfinite(weight) or weight <= 0:
        raise GoodputError(
            where,
            f"weight {weight_text} must be positive and finite",
            "remove the line to drop a file, or give it a positive weight",
        )
    prefix = Path(prefix_text)
    for suffix in (".bin", ".idx"):
        if prefix.name.endswith(suffix):
            prefix = prefix.with_name(prefix.name[: -len(suffix)])
    if not prefix.is_absolute():
        prefix = (Path(path).parent / prefix).resolve()
    for file in (bin_path(prefix), idx_path(prefix)):
        if not file.is_file():
            raise GoodputError(
                where,
                f"'{file}' does not exist",
                "fix the path prefix (without .bin/.idx) or tokenize it first",
            )
    return FileListEntry(weight, prefix, corpus, number)


def build_blend(spec: BlendSpec) -> tuple[Path, dict[str, Any]]:
    """Build (or find in the cache) the blend of ``spec``; return its directory and manifest."""
    if min(spec.seq_len, spec.num_samples, spec.report_batch_size) < 1:
        raise GoodputError.usage(
            "blend",
            "--seq-len, --num-samples and --report-batch-size must be positive",
            "pass positive values",
        )
    if spec.on_exhausted not in ON_EXHAUSTED:
        raise GoodputError.usage(
            "blend",
            f"--on-exhausted {spec.on_exhausted!r} is not valid",
            f"use one of {', '.join(ON_EXHAUSTED)}",
        )
    entries = parse_file_list(spec.file_list)
    shards, tokenizer = _describe_shards(entries, spec)
    corpora = list(dict.fromkeys(e.corpus for e in entries))
    totals = {c: sum(e.weight for e in entries if e.corpus == c) for c in corpora}
    weight_sum = sum(totals.values())
    pinned: dict[str, Any] = {
        "format": RUN_FORMAT,
        "tokenizer": tokenizer,
        "shards": shards,
        "weights": [[c, totals[c] / weight_sum] for c in corpora],
        "seed": spec.seed,
        "seq_len": spec.seq_len,
        "num_samples": spec.num_samples,
        "on_exhausted": spec.on_exhausted,
    }
    blend_fingerprint, components = fingerprint(pinned)
    final = spec.output / "blends" / blend_fingerprint[:20]
    if is_complete(final):
        print(f"blend: cached at {final}", file=sys.stderr)
        return final, _cached_manifest(final, spec.report_batch_size)
    manifest = {
        **pinned,
        "fingerprint": blend_fingerprint,
        "components": components,
        "goodput_version": __version__,
        "git_sha": git_sha(),
    }
    manifest["report"] = _build_into(final, manifest, spec)
    return final, manifest


def _describe_shards(entries: list[FileListEntry], spec: BlendSpec) -> tuple[list[dict], Any]:
    """Checksums and sample counts of every listed shard; one tokenizer across all of them."""
    shards, tokenizers = [], {}
    index = ShardIndex()
    for entry in entries:
        where = f"{spec.file_list}:{entry.line}"
        reader = ShardReader(entry.prefix)  # validates the .idx/.bin pair
        found = index.find(entry.prefix)
        if found is None:  # a shard from Megatron or datatrove: hash it ourselves
            print(f"blend: {entry.prefix} has no goodput manifest; hashing it", file=sys.stderr)
            sha_bin, sha_idx = (
                sha256_file(bin_path(entry.prefix)),
                sha256_file(idx_path(entry.prefix)),
            )
            tokenizer, packed = None, None
        else:
            dataset, shard = found
            if shard["num_tokens"] != reader.num_tokens:
                raise GoodputError(
                    bin_path(entry.prefix),
                    "token count differs from its manifest",
                    "run `goodput data inspect` on it; re-tokenize",
                )
            sha_bin, sha_idx = shard["sha256_bin"], shard["sha256_idx"]
            tokenizer, packed = dataset["tokenizer"], dataset.get("pack_seq_len")
        if packed is not None and packed != spec.seq_len:
            raise GoodputError(
                where,
                f"shard is packed for seq_len {packed}, the blend asks for {spec.seq_len}",
                f"pass --seq-len {packed} or re-tokenize",
            )
        if tokenizer is not None:
            tokenizers[tokenizer["sha256"], tokenizer["library"]] = (where, tokenizer)
        num_samples = len(reader) if packed else max(reader.num_tokens - 1, 0) // spec.seq_len
        shards.append(
            {
                "prefix": str(entry.prefix),
                "corpus": entry.corpus,
                "sha256_bin": sha_bin,
                "sha256_idx": sha_idx,
                "packed": bool(packed),
                "num_tokens": reader.num_tokens,
                "num_documents": len(reader),
                "num_samples": num_samples,
            }
        )
    if len(tokenizers) > 1:
        (where_a, _), (where_b, _) = list(tokenizers.values())[:2]
        raise GoodputError(
            where_b,
            f"tokenized with a different tokenizer than {where_a}",
            "blend only shards made with one tokenizer",
        )
    tokenizer = next(iter(tokenizers.values()))[1] if tokenizers else None
    return shards, tokenizer


def _build_into(final: Path, manifest: dict[str, Any], spec: BlendSpec) -> dict[str, Any]:
    """Write every index of the blend into a temp dir, then rename it to ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        shards = manifest["shards"]
        for shard in shards:
            if not shard["packed"]:
                build_file_index(Path(shard["prefix"]), shard["sha256_bin"], spec.seed, spec.output)
        weights = np.array([w for _, w in manifest["weights"]])
        corpus_index, sample_index = build_blend_index(weights, spec.num_samples)
        report = _mixture_report(manifest, corpus_index, spec.report_batch_size)
        _refuse_exhausted(report, spec)
        np.save(tmp / "corpus_index.npy", corpus_index)
        np.save(tmp / "sample_index.npy", sample_index)
        for c, row in enumerate(report["corpora"]):
            order = corpus_order(row["corpus"], row["available"], row["samples"], spec.seed)
            np.save(tmp / f"corpus_{c:04d}.npy", order)
        write_json(tmp / "blend.json", {**manifest, "report": report})
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
    return report


def file_index_dir(output: Path, sha256_bin: str, seed: int) -> Path:
    return output / "files" / f"{sha256_bin[:32]}-seed{seed}"


def build_file_index(prefix: Path, sha256_bin: str, seed: int, output: Path) -> Path:
    """Seeded document order of one shard and the start of each document in that order."""
    directory = file_index_dir(output, sha256_bin, seed)
    if is_complete(directory):
        return directory
    reader = ShardReader(prefix)
    rng = np.random.default_rng([seed, int(sha256_bin[:16], 16)])
    order = rng.permutation(len(reader)).astype(np.int64)
    starts = np.zeros(len(reader) + 1, np.int64)
    np.cumsum(reader.document_lengths[order], out=starts[1:])
    directory.mkdir(parents=True, exist_ok=True)
    for name, array in (("document_order.npy", order), ("document_starts.npy", starts)):
        _save_atomic(directory / name, array)
    write_marker(directory)
    return directory


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def corpus_order(corpus: str, available: int, needed: int, seed: int) -> np.ndarray:
    """The first ``needed`` samples of a corpus: one fresh seeded permutation per epoch."""
    if needed and not available:
        raise GoodputError(
            corpus, "corpus has no complete sample", "add data to it or lower --seq-len"
        )
    dtype = np.uint32 if available <= np.iinfo(np.uint32).max else np.int64
    corpus_key = int(hashlib.sha256(corpus.encode()).hexdigest()[:16], 16)
    epochs = []
    for epoch in range(-(-needed // available) if needed else 0):
        rng = np.random.default_rng([seed, corpus_key, epoch])
        epochs.append(rng.permutation(available).astype(dtype))
    return np.concatenate(epochs)[:needed] if epochs else np.zeros(0, dtype)


def _cached_manifest(directory: Path, batch_size: int) -> dict[str, Any]:
    """A built blend's manifest, its report redone when asked for another batch size."""
    manifest = read_json(directory / "blend.json")
    if manifest["report"]["batch_size"] != batch_size:
        corpus_index = np.load(directory / "corpus_index.npy", mmap_mode="r")
        manifest["report"] = _mixture_report(manifest, corpus_index, batch_size)
    return manifest


def _mixture_report(
    manifest: dict[str, Any], corpus_index: np.ndarray, batch_size: int
) -> dict[str, Any]:
    """Per corpus: target and achieved share, worst aligned-batch deviation, epochs."""
    names = [name for name, _ in manifest["weights"]]
    weights = np.array([w for _, w in manifest["weights"]])
    deviation = max_batch_deviation(corpus_index, weights, batch_size)
    needed = np.bincount(corpus_index, minlength=len(names))
    rows = []
    for c, name in enumerate(names):
        files = [s for s in manifest["shards"] if s["corpus"] == name]
        available = sum(s["num_samples"] for s in files)
        rows.append(
            {
                "corpus": name,
                "target": float(weights[c]),
                "achieved": float(needed[c] / len(corpus_index)),
                "worst_batch_deviation": float(deviation[c]),
                "samples": int(needed[c]),
                "available": int(available),
                "epochs": float(needed[c] / available) if available else math.inf,
                "files": len(files),
            }
        )
    return {"batch_size": batch_size, "corpora": rows}


def _refuse_exhausted(report: dict[str, Any], spec: BlendSpec) -> None:
    for row in report["corpora"]:
        if row["epochs"] > 1 and spec.on_exhausted == "error":
            raise GoodputError(
                spec.file_list,
                f"corpus '{row['corpus']}' needs {row['samples']:,} samples but holds "
                f"{row['available']:,} ({row['epochs']:.2f} epochs)",
                "lower its weight or --num-samples, add data, or pass --on-exhausted repeat",
            )


def format_report(blend_dir: Path, manifest: dict[str, Any]) -> str:
    """The mixture report as a table, with a loud line for every repeated corpus."""
    report = manifest["report"]
    lines = [
        f"blend {blend_dir}",
        f"  {manifest['num_samples']:,} samples of {manifest['seq_len'] + 1} tokens, "
        f"seed {manifest['seed']}, fingerprint {manifest['fingerprint'][:16]}",
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
    return "\n".join(lines)
