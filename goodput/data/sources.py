"""What a blend reads: its stages' file lists and the shards they name, checked as one set.

Owns reading every stage's file list (``read_stages``), the blend's shards across stages
(``blend_entries``: corpora in order of first appearance, stage 0's first, so appending a stage
never renumbers a corpus) and the pinned description of each shard (``describe_shards``:
checksums, counts, one tokenizer). A corpus named by two stages must list the same shards in
both — its order is one sequence across stages — and a shard belongs to one corpus: both are
refused naming both file lists.

It does not interleave (``stages``) nor build indices (``blend``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput.data.file_list import FileListEntry, corpus_weights, listed_twice, parse_file_list
from goodput.data.manifest import ShardIndex, shard_samples
from goodput.data.paths import file_identity
from goodput.data.shards import ShardReader, bin_path, idx_path
from goodput.data.stages import BlendStage
from goodput.errors import GoodputError
from goodput.io import sha256_file


@dataclass(frozen=True, slots=True)
class StageSource:
    """One stage's file list, read: its lines and its corpora's ``[name, share]`` pairs."""

    stage: BlendStage
    entries: list[FileListEntry]
    weights: list[list[Any]]
    sha256: str  # of the file list's bytes: recorded, not fingerprinted (a comment is no change)


@dataclass(frozen=True, slots=True)
class SourcedEntry:
    """A file-list line and the file list it is on."""

    file_list: Path
    entry: FileListEntry

    @property
    def where(self) -> str:
        return f"{self.file_list}:{self.entry.line}"


def read_stages(stages: tuple[BlendStage, ...]) -> list[StageSource]:
    sources = []
    for stage in stages:
        entries = parse_file_list(stage.file_list)
        weights = corpus_weights(entries, stage.file_list)
        sources.append(StageSource(stage, entries, weights, sha256_file(stage.file_list)))
    return sources


def blend_entries(sources: list[StageSource]) -> list[SourcedEntry]:
    """Every shard of the blend once: each corpus's lines from the first stage naming it,
    checked against every later stage naming it."""
    first_lines: dict[str, list[SourcedEntry]] = {}
    for source in sources:
        lines: dict[str, list[SourcedEntry]] = {}
        for entry in source.entries:
            lines.setdefault(entry.corpus, []).append(SourcedEntry(source.stage.file_list, entry))
        for corpus, corpus_lines in lines.items():
            first = first_lines.setdefault(corpus, corpus_lines)
            if _identities(first) != _identities(corpus_lines):
                raise GoodputError.usage(
                    corpus_lines[0].file_list,
                    f"corpus '{corpus}' lists other shards than in {first[0].file_list}",
                    "a corpus keeps its shards across stages: list the same ones, or name "
                    "the new set as another corpus",
                )
    return [line for corpus_lines in first_lines.values() for line in corpus_lines]


def _identities(lines: list[SourcedEntry]) -> set[tuple[int, int]]:
    return {file_identity(bin_path(line.entry.prefix)) for line in lines}


def describe_shards(entries: list[SourcedEntry], seq_len: int) -> tuple[list[dict], Any]:
    """Checksums and sample counts of every listed shard; one tokenizer across all of them."""
    shards, tokenizers = [], {}
    by_checksum: dict[str, SourcedEntry] = {}
    index = ShardIndex()
    for line in entries:
        shard, tokenizer, packed = _describe(line, index)
        first = by_checksum.setdefault(shard["sha256_bin"], line)
        if first is not line:
            raise _twice(first, line)
        if packed is not None and packed != seq_len:
            raise GoodputError(
                line.where,
                f"shard is packed for seq_len {packed}, the blend asks for {seq_len}",
                f"pass --seq-len {packed} or re-tokenize",
            )
        if tokenizer is not None:
            tokenizers[tokenizer["sha256"], tokenizer["library"]] = (line.where, tokenizer)
        shards.append({**shard, "num_samples": shard_samples(shard, seq_len)})
    if len(tokenizers) > 1:
        (where_a, _), (where_b, _) = list(tokenizers.values())[:2]
        raise GoodputError(
            where_b,
            f"tokenized with a different tokenizer than {where_a}",
            "blend only shards made with one tokenizer",
        )
    tokenizer = next(iter(tokenizers.values()))[1] if tokenizers else None
    return shards, tokenizer


def _describe(line: SourcedEntry, index: ShardIndex) -> tuple[dict[str, Any], Any, Any]:
    """(the shard's pinned fields, its tokenizer or None, its pack length or None)."""
    prefix = line.entry.prefix
    reader = ShardReader(prefix)  # validates the .idx/.bin pair
    found = index.find(prefix)
    if found is None:  # a shard from Megatron or datatrove: hash it ourselves
        print(f"blend: {prefix} has no goodput manifest; hashing it", file=sys.stderr)
        sha_bin, sha_idx = sha256_file(bin_path(prefix)), sha256_file(idx_path(prefix))
        tokenizer, packed = None, None
    else:
        dataset, shard = found
        if shard["num_tokens"] != reader.num_tokens:
            raise GoodputError(
                bin_path(prefix),
                "token count differs from its manifest",
                "run `goodput data inspect` on it; re-tokenize",
            )
        sha_bin, sha_idx = shard["sha256_bin"], shard["sha256_idx"]
        tokenizer, packed = dataset["tokenizer"], dataset.get("pack_seq_len")
    described = {
        "prefix": str(prefix),
        "corpus": line.entry.corpus,
        "sha256_bin": sha_bin,
        "sha256_idx": sha_idx,
        "packed": bool(packed),
        "num_tokens": reader.num_tokens,
        "num_documents": len(reader),
    }
    return described, tokenizer, packed


def _twice(first: SourcedEntry, again: SourcedEntry) -> GoodputError:
    if first.file_list == again.file_list:
        return listed_twice(again.file_list, first.entry, again.entry, "a byte-identical copy of")
    return GoodputError(
        again.where,
        f"'{again.entry.prefix}' (corpus '{again.entry.corpus}') is the same shard as "
        f"'{first.entry.prefix}' (corpus '{first.entry.corpus}') on {first.where}",
        "a shard belongs to one corpus in every stage",
    )
