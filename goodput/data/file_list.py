"""File lists: ``weight path-prefix corpus`` lines naming the shards of a blend.

Owns ``parse_file_list`` and ``corpus_weights``. Parsing is strict and every problem is one line
naming ``file:line``: the file must be UTF-8 (``goodput.io.read_text``), a weight a finite number
> 0, a prefix an existing ``.bin``/``.idx`` pair (relative prefixes resolve against the list's
own folder, so a list travels with its data), and each shard listed once — two lines reaching
one file, by another path or a symbolic or hard link (same ``st_dev``/``st_ino``), name both
lines. Weights are summed per corpus and must leave every corpus a share the interleave can use
(no overflow, none rounding to zero).

It does not open the shards (``blend`` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput import io
from goodput.data.interleave import MAX_CORPORA, normalise_weights
from goodput.data.paths import file_identity
from goodput.data.shards import bin_path, idx_path
from goodput.errors import GoodputError


@dataclass(frozen=True, slots=True)
class FileListEntry:
    weight: float
    prefix: Path
    corpus: str
    line: int


def parse_file_list(path: Path) -> list[FileListEntry]:
    """Read ``weight path-prefix corpus`` lines; ``#`` comments and blank lines are skipped.

    Relative prefixes are resolved against the file list's own directory, so a list travels
    with its data. A shard reached by two lines (another path, a link) is refused.
    """
    entries = []
    seen: dict[tuple[int, int], FileListEntry] = {}
    for number, raw in enumerate(io.read_text(path).splitlines(), start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        entry = _parse_line(path, number, text)
        first = seen.setdefault(file_identity(bin_path(entry.prefix)), entry)
        if first is not entry:
            raise listed_twice(path, first, entry, "the same file as")
        entries.append(entry)
    if not entries:
        raise GoodputError(
            path, "file list has no entries", "add lines of 'weight path-prefix corpus'"
        )
    if len({e.corpus for e in entries}) > MAX_CORPORA:
        raise GoodputError(
            path, f"more than {MAX_CORPORA} corpora", "merge corpora into fewer names"
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
    try:  # a loop of links on the way is named as one, never as a missing file
        if not prefix.is_absolute():
            prefix = io.resolved(Path(path).parent / prefix)
        for file in (bin_path(prefix), idx_path(prefix)):
            if io.path_status(file) is None:
                raise GoodputError(
                    where,
                    f"'{file}' does not exist",
                    "fix the path prefix (without .bin/.idx) or tokenize it first",
                )
    except GoodputError as error:
        if error.where == where:
            raise
        raise GoodputError(where, f"'{error.where}': {error.what}", error.fix) from None
    return FileListEntry(weight, prefix, corpus, number)


def listed_twice(path: Path, first: FileListEntry, again: FileListEntry, how: str) -> GoodputError:
    return GoodputError(
        f"{path}:{again.line}",
        f"'{again.prefix}' is {how} '{first.prefix}' on {path}:{first.line}",
        "list each shard once; its weight is what sets how often it is read",
    )


def corpus_weights(entries: list[FileListEntry], file_list: Path) -> list[list[Any]]:
    """``[corpus, share]`` pairs: each corpus's lines' weights over all weights."""
    totals: dict[str, float] = {}
    running = 0.0
    for entry in entries:
        totals[entry.corpus] = totals.get(entry.corpus, 0.0) + entry.weight
        running += entry.weight
        if not math.isfinite(running):
            raise GoodputError(
                f"{file_list}:{entry.line}",
                "the weights up to this line add up to more than a float can hold",
                "use smaller weights: only their ratios matter",
            )
    weight_sum = sum(totals.values())
    shares = {corpus: total / weight_sum for corpus, total in totals.items()}
    try:  # what the interleave will ask of them: the smallest must not vanish next to the rest
        normalise_weights(list(shares.values()))
    except ValueError:
        smallest = min(shares, key=shares.__getitem__)
        line = next(e.line for e in entries if e.corpus == smallest)
        raise GoodputError(
            f"{file_list}:{line}",
            f"corpus '{smallest}' gets a share of {shares[smallest]:.3g}, too small to blend",
            "use weights of closer magnitudes, or remove the corpus",
        ) from None
    return [[corpus, share] for corpus, share in shares.items()]
