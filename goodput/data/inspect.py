"""``goodput data inspect``: what a shard or dataset holds, checked against its manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from goodput.data.manifest import ShardIndex, check_shard, read_dataset_manifest
from goodput.data.shards import ShardReader

PREVIEW_TOKENS = 32


def describe(path: Path, tokenizer_path: Path | None = None) -> dict[str, Any]:
    """Counts, dtype, the first document and checksum problems of a shard or a dataset."""
    if path.name.endswith(".manifest.json"):
        manifest = read_dataset_manifest(path)
        prefixes = [path.parent / shard["shard"] for shard in manifest["shards"]]
    else:
        prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
        prefixes = [prefix]
    readers = [ShardReader(p) for p in prefixes]
    problems = []
    index = ShardIndex()
    for prefix in prefixes:
        found = index.find(prefix)
        if found is None:
            problems.append(f"{prefix}: no goodput manifest lists this shard (cannot verify)")
        else:
            problems += check_shard(prefix, found[1]["sha256_bin"], found[1]["sha256_idx"])
    first = next((r[0] for r in readers if len(r)), None)
    info: dict[str, Any] = {
        "path": str(path),
        "shards": [str(p) for p in prefixes],
        "dtype": readers[0].dtype.name,
        "documents": sum(len(r) for r in readers),
        "tokens": sum(r.num_tokens for r in readers),
        "first_document_tokens": [] if first is None else first[:PREVIEW_TOKENS].tolist(),
        "first_document_length": 0 if first is None else len(first),
        "problems": problems,
    }
    if tokenizer_path is not None and first is not None:
        from goodput.data.tokenizer import load_tokenizer

        info["first_document_text"] = load_tokenizer(tokenizer_path).decode(first.tolist())
    return info


def format_description(info: dict[str, Any]) -> str:
    lines = [
        f"{info['path']}: {len(info['shards'])} shard(s), {info['documents']:,} documents, "
        f"{info['tokens']:,} tokens, dtype {info['dtype']}",
        f"first document: {info['first_document_length']:,} tokens, starts "
        f"{info['first_document_tokens']}",
    ]
    if "first_document_text" in info:
        lines.append("first document, decoded:")
        lines.append(info["first_document_text"][:2000])
    lines += [f"PROBLEM: {p}" for p in info["problems"]]
    lines.append("checksums: " + ("FAILED" if info["problems"] else "ok (match the manifest)"))
    return "\n".join(lines)
