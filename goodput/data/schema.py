"""What the JSON files of the data part must hold, checked once when they are read.

Owns the field specs of a dataset manifest (``<name>.manifest.json``), a tokenize part record
(``.parts/<shard>.json``), a run manifest (``blend.json``) and the loader state a checkpoint
holds, and ``check``, which walks a parsed value against a spec. Every field the code reads
later is here with its type and range, so past ``check`` a manifest from disk is as trustworthy
as one we built: a missing key, a wrong type, a negative count, a checksum that is not hex or a
shard name with a path in it is one ``GoodputError`` naming the file and the field, never a
``KeyError`` later. Keys not in a spec are ignored (older and newer writers may add some).

It does not read files (``goodput.io.read_json`` does) nor judge content against the disk.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from goodput.data.paths import is_safe_name
from goodput.errors import GoodputError

# A spec is a rule (what it expects, and a predicate), a dict of specs (an object with at least
# those keys), a one-element list (a JSON array, every item matching the spec in it) or
# ``Nullable`` (null, or the spec in it).
Rule = tuple[str, Callable[[Any], bool]]
Spec = Any

SHARDS_FORMAT = "goodput.shards/1"
RUN_FORMAT = "goodput.blend/1"
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class Nullable:
    spec: Spec


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _number(value: Any) -> bool:
    return type(value) in (int, float) and not math.isnan(value)


def one_of(*values: str) -> Rule:
    return (f"one of {', '.join(map(repr, values))}", lambda v: v in values)


def pair(first: Rule, second: Rule) -> Rule:
    return (
        f"a pair [{first[0]}, {second[0]}]",
        lambda v: isinstance(v, list) and len(v) == 2 and first[1](v[0]) and second[1](v[1]),
    )


TEXT: Rule = ("a string", lambda v: isinstance(v, str))
COUNT: Rule = ("a whole number >= 0", _count)
POSITIVE: Rule = ("a whole number >= 1", lambda v: _count(v) and v >= 1)
BOOL: Rule = ("true or false", lambda v: type(v) is bool)
NUMBER: Rule = ("a number", _number)
SHARE: Rule = ("a number in (0, 1]", lambda v: _number(v) and 0 < v <= 1)
SHA256: Rule = ("a sha256 hex digest", lambda v: isinstance(v, str) and bool(_HEX64.fullmatch(v)))
NAME: Rule = ("a plain file name", is_safe_name)

TOKENIZER = {
    "kind": TEXT,
    "path": TEXT,
    "sha256": SHA256,
    "library": TEXT,
    "vocab_size": POSITIVE,
    "eod_id": COUNT,
}
DATASET_SHARD = {"shard": NAME, "sha256_bin": SHA256, "sha256_idx": SHA256, "num_tokens": COUNT}
DATASET_MANIFEST = {
    "format": one_of(SHARDS_FORMAT),
    "job_key": TEXT,
    "tokenizer": TOKENIZER,
    "pack_seq_len": Nullable(POSITIVE),
    "num_documents": COUNT,
    "num_tokens": COUNT,
    "num_empty_skipped": COUNT,
    "shards": [DATASET_SHARD],
}
PART_RECORD = {
    **DATASET_SHARD,
    "job_key": TEXT,
    "bin_bytes": COUNT,
    "idx_bytes": COUNT,
    "num_documents": COUNT,
    "num_empty_skipped": COUNT,
    "num_tokens_dropped": COUNT,
    "inputs": [{"path": TEXT, "bytes": COUNT}],
}
RUN_SHARD = {
    "prefix": TEXT,
    "corpus": TEXT,
    "sha256_bin": SHA256,
    "sha256_idx": SHA256,
    "packed": BOOL,
    "num_tokens": COUNT,
    "num_documents": COUNT,
    "num_samples": COUNT,
}
REPORT_ROW = {
    "corpus": TEXT,
    "target": NUMBER,
    "achieved": NUMBER,
    "worst_batch_deviation": NUMBER,
    "samples": COUNT,
    "available": COUNT,
    "epochs": NUMBER,
    "files": COUNT,
}
STAGE_ROW = {
    "name": TEXT,
    "target": NUMBER,
    "achieved": NUMBER,
    "worst_batch_deviation": NUMBER,
    "samples": COUNT,
    "first_sample": COUNT,
    "epochs": NUMBER,
    "wrapped": BOOL,
}
# One entry of a run manifest's "stages" (``goodput.data.stages``); a blend built before stages
# has none, and reads as one stage (``manifest.read_run_manifest``).
STAGE = {
    "start_sample": COUNT,
    "file_list": TEXT,
    "file_list_sha256": Nullable(SHA256),
    "weights": [pair(TEXT, SHARE)],
    "report": {"batch_size": POSITIVE, "corpora": [STAGE_ROW]},
}
# The fingerprint's components, each a digest by name (``manifest.changed_components``).
COMPONENTS: Rule = (
    "an object of names to digests",
    lambda v: isinstance(v, dict) and all(isinstance(item, str) for item in v.values()),
)
LOADER_STATE = {"consumed_samples": COUNT, "fingerprint": TEXT, "components": COMPONENTS}
# The loader state's "prefix" (``goodput.data.prefix``); older checkpoints have none.
PREFIX_RECORD = {"chain": SHA256, "sha256": SHA256}
RUN_MANIFEST = {
    "format": one_of(RUN_FORMAT),
    "tokenizer": Nullable(TOKENIZER),
    "shards": [RUN_SHARD],
    "weights": [pair(TEXT, SHARE)],
    "seed": COUNT,
    "seq_len": POSITIVE,
    "num_samples": POSITIVE,
    "on_exhausted": one_of("repeat", "error"),
    "fingerprint": SHA256,
    "components": {},
    "report": {"batch_size": POSITIVE, "corpora": [REPORT_ROW]},
    "index_sha256": {},
}


def check_loader_state(where: object, state: Any, field: str = "loader") -> None:
    """``state`` if it is the loader state a checkpoint holds under ``field`` (its position,
    fingerprint, and the prefix digest and stage starts that older checkpoints lack); else a
    ``GoodputError`` naming ``where`` and the field. Whether the position lies within a blend
    is the loader's to judge (``DataLoader.load_state_dict``)."""
    check(where, state, LOADER_STATE, field)
    if state.get("prefix") is not None:
        check(where, state["prefix"], PREFIX_RECORD, f"{field}.prefix")
    if "stage_starts" in state:
        check(where, state["stage_starts"], [COUNT], f"{field}.stage_starts")


def check(where: object, value: Any, spec: Spec, field: str = "") -> None:
    """Raise a ``GoodputError`` naming ``where`` (a file) and the field where ``value`` breaks
    ``spec``."""
    if isinstance(spec, Nullable):
        if value is not None:
            check(where, value, spec.spec, field)
    elif isinstance(spec, dict):
        if not isinstance(value, dict):
            raise _bad(where, field, f"must be an object, got {_shown(value)}")
        for key, item_spec in spec.items():
            item = f"{field}.{key}" if field else key
            if key not in value:
                raise _bad(where, item, "is missing")
            check(where, value[key], item_spec, item)
    elif isinstance(spec, list):
        if not isinstance(value, list):
            raise _bad(where, field, f"must be an array, got {_shown(value)}")
        for i, item in enumerate(value):
            check(where, item, spec[0], f"{field}[{i}]")
    elif not spec[1](value):
        raise _bad(where, field, f"must be {spec[0]}, got {_shown(value)}")


def _shown(value: Any) -> str:
    return reprlib.repr(value)  # bounded however large the value is


def _bad(where: object, field: str, what: str) -> GoodputError:
    return GoodputError(
        where,
        f"field {field or '(the whole file)'} {what}",
        "the file is damaged or not goodput's; rebuild it with the command that wrote it",
    )
