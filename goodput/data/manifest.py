"""Pinning: dataset manifests, the run manifest of a blend, fingerprints and verification.

A *dataset manifest* (``<name>.manifest.json``, written last by ``goodput data tokenize``) lists
every shard with its sha256, counts and dtype, the tokenizer's identity and the inputs. A *run
manifest* (``blend.json`` in a blend directory) pins what a training run reads: tokenizer
identity, every shard's checksum, corpus weights, seed, seq_len, num_samples, plus the goodput
version and git SHA that built it. Its fingerprint is a hash of per-component hashes
(``components``), so a mismatch can name *what* changed, not only that something did. The
version and git SHA are recorded but not fingerprinted: they do not change the data. A blend
of several data-mix stages (``stages``) records each (``stages``: start, file list and its
sha256, weights, report); its components are stage 0's, as a plain blend's, plus ``stage k``
for each later stage, and a blend built before stages reads as one stage. Not fingerprinted
either is
``index_sha256``, the checksum of every index array the blend reads (see ``index_files``), which
``verify_run`` re-hashes.

Every manifest is read through ``read_dataset_manifest``, ``read_part_record`` or
``read_run_manifest``: bounded, strict UTF-8 and checked field by field (``schema``), so a damaged
or foreign file is one line naming it and the field.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from goodput import io
from goodput.data import schema
from goodput.data.index_files import index_problems, open_index, rebuild_fix
from goodput.data.interleave import MAX_CORPORA
from goodput.data.shards import bin_path, idx_path
from goodput.data.stages import MAX_STAGES
from goodput.errors import GoodputError
from goodput.io import is_complete, sha256_json

FINGERPRINTED = (
    "tokenizer",
    "shards",
    "weights",
    "seed",
    "seq_len",
    "num_samples",
    "on_exhausted",
    "format",
)
# Fingerprinted when present: absent, the blend is one built before it existed (or with none).
FINGERPRINTED_IF_SET = ("holdout_samples",)


def manifest_path(directory: Path, name: str) -> Path:
    return Path(directory) / f"{name}.manifest.json"


def read_dataset_manifest(path: Path) -> dict[str, Any]:
    return _read(path, schema.DATASET_MANIFEST)


def read_part_record(path: Path) -> dict[str, Any]:
    return _read(path, schema.PART_RECORD)


def read_run_manifest(path: Path) -> dict[str, Any]:
    """A ``blend.json`` whose fields have their types and agree with each other. One built
    before index checksums were recorded is refused with the fix: rebuild it."""
    manifest = io.read_json(path)
    if isinstance(manifest, dict) and "index_sha256" not in manifest:
        version = str(manifest.get("goodput_version", "(unknown)"))[:40]
        raise GoodputError(
            path,
            f"built by goodput {version} without index checksums, so a changed index could "
            "not be noticed",
            rebuild_fix(path.parent),
        )
    schema.check(path, manifest, schema.RUN_MANIFEST)
    if "stages" not in manifest:
        manifest["stages"] = _legacy_stages(manifest)
    schema.check(path, manifest["stages"], [schema.STAGE], "stages")
    if manifest["stages"]:  # stage 0's weights are the fingerprinted ones; its copy is a note
        manifest["stages"][0]["weights"] = manifest["weights"]
    _check_consistent(path, manifest)
    return manifest


def _check_consistent(path: Path, manifest: dict[str, Any]) -> None:
    """Corpora, shards, report and stages of a run manifest agree: what the loader relies on."""
    names = corpus_names(manifest)
    weighed = {name for stage in manifest["stages"] for name, _ in stage["weights"]}
    rows = manifest["report"]["corpora"]
    if not 1 <= len(names) <= MAX_CORPORA:
        raise _inconsistent(path, "the shards must name 1 or more corpora")
    available = dict.fromkeys(names, 0)
    for i, shard in enumerate(manifest["shards"]):
        if shard["corpus"] not in weighed:
            raise _inconsistent(path, f"shards[{i}] is of corpus {shard['corpus']!r}, unweighted")
        if shard["num_samples"] != shard_samples(shard, manifest["seq_len"]):
            raise _inconsistent(path, f"shards[{i}].num_samples does not follow from its counts")
        available[shard["corpus"]] += shard["num_samples"]
    if [row["corpus"] for row in rows] != names:
        raise _inconsistent(path, "the report's corpora are not the weights' corpora")
    if sum(row["samples"] for row in rows) != manifest["num_samples"]:
        raise _inconsistent(path, "the report's samples do not add up to num_samples")
    if [row["available"] for row in rows] != list(available.values()):
        raise _inconsistent(path, "the report's available samples are not the shards' sum")
    if "holdout_samples" in manifest:
        schema.check(path, manifest["holdout_samples"], schema.POSITIVE, "holdout_samples")
        held = manifest["holdout_samples"]
        if any(row.get("heldout") != held or row["available"] <= held for row in rows):
            raise _inconsistent(path, "the report's held-out samples are not holdout_samples")
    _check_stages_consistent(path, manifest, names)


def _check_stages_consistent(path: Path, manifest: dict[str, Any], names: list[str]) -> None:
    """Stage 0 starts at sample 0; starts increase inside the run; every
    stage weighs corpora of the blend, each once, and every corpus is weighed by some stage."""
    stages = manifest["stages"]
    starts = [stage["start_sample"] for stage in stages]
    if not 1 <= len(stages) <= MAX_STAGES or starts[0] != 0:
        raise _inconsistent(path, f"stages must be 1 to {MAX_STAGES}, the first at sample 0")
    if starts != sorted(set(starts)) or starts[-1] >= manifest["num_samples"]:
        raise _inconsistent(path, "stage starts must increase and stay below num_samples")
    weighed: set[str] = set()
    for k, stage in enumerate(stages):
        stage_names = [name for name, _ in stage["weights"]]
        if len(set(stage_names)) != len(stage_names) or not set(stage_names) <= set(names):
            raise _inconsistent(path, f"stages[{k}].weights must name corpora of the shards once")
        if [row["name"] for row in stage["report"]["corpora"]] != stage_names:
            raise _inconsistent(path, f"stages[{k}].report names other corpora than its weights")
        weighed.update(stage_names)
    if names[: len(manifest["weights"])] != [name for name, _ in manifest["weights"]]:
        raise _inconsistent(path, "stage 0's corpora must come first in the shards")
    if weighed != set(names):
        raise _inconsistent(path, "a corpus of the shards has no weight in any stage")


def corpus_names(manifest: dict[str, Any]) -> list[str]:
    """The blend's corpora, numbered as its index numbers them: in order of first appearance
    in its shards (stage 0's first, then those each later stage adds)."""
    return list(dict.fromkeys(shard["corpus"] for shard in manifest["shards"]))


def _legacy_stages(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The one stage of a blend built before stages were recorded: what its report says."""
    rows = [
        {
            "name": row["corpus"],
            "target": row["target"],
            "achieved": row["achieved"],
            "worst_batch_deviation": row["worst_batch_deviation"],
            "samples": row["samples"],
            "first_sample": 0,
            "epochs": row["epochs"],
            "wrapped": row["epochs"] > 1,
        }
        for row in manifest["report"]["corpora"]
    ]
    report = {"batch_size": manifest["report"]["batch_size"], "corpora": rows}
    return [
        {
            "start_sample": 0,
            "file_list": "(not recorded: built before stages)",
            "file_list_sha256": None,
            "weights": manifest["weights"],
            "report": report,
        }
    ]


def shard_samples(shard: dict[str, Any], seq_len: int) -> int:
    """Samples of ``seq_len + 1`` tokens a shard holds: a row each when packed, else windows
    of its token stream overlapping by one token."""
    if shard["packed"]:
        return int(shard["num_documents"])
    return max(int(shard["num_tokens"]) - 1, 0) // seq_len


def _read(path: Path, spec: schema.Spec) -> dict[str, Any]:
    value = io.read_json(path)
    schema.check(path, value, spec)
    return value  # type: ignore[no-any-return]  # check() proved it is an object


def _inconsistent(path: Path, what: str) -> GoodputError:
    return GoodputError(path, f"inconsistent run manifest: {what}", rebuild_fix(path.parent))


class ShardIndex:
    """Finds the dataset manifest that lists a shard, reading each directory's manifests once
    (a blend of thousands of shards must not re-read them per shard)."""

    def __init__(self) -> None:
        self._by_directory: dict[Path, dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {}

    def find(self, prefix: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(dataset manifest, its entry for ``prefix``), or None for a foreign shard."""
        directory = prefix.parent
        if directory not in self._by_directory:
            self._by_directory[directory] = {
                shard["shard"]: (manifest, shard)
                for candidate in io.regular_files(directory.glob("*.manifest.json"))
                for manifest in [read_dataset_manifest(candidate)]
                for shard in manifest["shards"]
            }
        return self._by_directory[directory].get(prefix.name)


def verify_dataset(manifest_file: Path) -> list[str]:
    """Re-hash every shard of a dataset manifest; return one line per problem (empty = ok)."""
    manifest = read_dataset_manifest(manifest_file)
    problems = []
    for shard in manifest["shards"]:
        prefix = manifest_file.parent / shard["shard"]
        problems += check_shard(prefix, shard["sha256_bin"], shard["sha256_idx"])
    return problems


def check_shard(prefix: Path, sha256_bin: str, sha256_idx: str) -> list[str]:
    problems = []
    for path, expected in ((bin_path(prefix), sha256_bin), (idx_path(prefix), sha256_idx)):
        if not path.exists():
            problems.append(f"{path}: missing")
        elif io.sha256_file(path) != expected:
            problems.append(f"{path}: checksum mismatch (the file changed since it was pinned)")
    return problems


def fingerprint(pinned: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """(fingerprint, per-component hashes) of the fingerprinted fields of a run manifest.

    The components of stage 0 are those of a blend without stages (its ``shards`` are those of
    stage 0's corpora), so a one-stage blend keeps its fingerprint; each later stage ``k`` adds
    a component ``stage k``: its start, weights and shards."""
    keys = [*FINGERPRINTED, *(key for key in FINGERPRINTED_IF_SET if key in pinned)]
    components = {key: sha256_json(_content(key, pinned[key], pinned))[:16] for key in keys}
    for k, stage in enumerate(pinned.get("stages", [])[1:], start=1):
        content = {
            "start_sample": stage["start_sample"],
            "weights": stage["weights"],
            "shards": _shard_content(pinned["shards"], stage["weights"]),
        }
        components[f"stage {k}"] = sha256_json(content)[:16]
    return sha256_json(components), components


def _content(key: str, value: Any, pinned: dict[str, Any]) -> Any:
    """What identifies a component's content: moving the data or the tokenizer file changes
    paths, not the fingerprint."""
    if key == "shards":
        return _shard_content(value, pinned["weights"])
    if key == "tokenizer" and value:
        return [value["sha256"], value["library"]]
    return value


def _shard_content(shards: list[dict[str, Any]], weights: list[list[Any]]) -> list[list[str]]:
    """The shards of the corpora ``weights`` names, by corpus and checksums."""
    names = {name for name, _ in weights}
    return [[s["corpus"], s["sha256_bin"], s["sha256_idx"]] for s in shards if s["corpus"] in names]


def changed_components(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    return sorted(k for k in set(expected) | set(actual) if expected.get(k) != actual.get(k))


def check_run_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Refuse a run manifest whose content no longer matches its recorded fingerprint."""
    actual, components = fingerprint(manifest)
    if actual != manifest.get("fingerprint"):
        changed = changed_components(manifest.get("components", {}), components)
        raise GoodputError(
            path,
            f"fingerprint mismatch: {', '.join(changed) or 'fingerprint'} "
            "edited after the blend was built",
            "rebuild the blend with `goodput data blend` instead of editing it",
        )


def open_blend(
    directory: Path, *, hash_index: bool = True
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The manifest and index arrays of a complete blend directory, after every check that
    does not re-hash the shards: fields, fingerprint, each array's dtype, length and (when
    ``hash_index``) checksum."""
    if not is_complete(directory):
        raise GoodputError(
            directory,
            "not a complete blend directory (no .complete)",
            "build it with `goodput data blend` and pass the directory it prints",
        )
    path = directory / "blend.json"
    manifest = read_run_manifest(path)
    check_run_manifest(path, manifest)
    return manifest, open_index(path, manifest, hashed=hash_index)


def verify_run(path: Path) -> list[str]:
    """Full check of a run manifest: its fingerprint, every shard's checksum, the tokenizer and
    every index array (header, size, checksum)."""
    manifest = read_run_manifest(path)
    problems = []
    try:
        check_run_manifest(path, manifest)
    except GoodputError as exc:
        problems.append(exc.render())
    for shard in manifest["shards"]:
        problems += check_shard(Path(shard["prefix"]), shard["sha256_bin"], shard["sha256_idx"])
    tokenizer = manifest["tokenizer"]
    # A tokenizer file that moved is fine (training never reads it); one that changed is not.
    tokenizer_file = Path(tokenizer["path"]) if tokenizer else None
    if (
        tokenizer_file
        and tokenizer_file.is_file()
        and io.sha256_file(tokenizer_file) != tokenizer["sha256"]
    ):
        problems.append(f"{tokenizer_file}: tokenizer file changed since it was pinned")
    return problems + index_problems(path, manifest)


def git_sha() -> str:
    """The goodput checkout's commit and a dirty flag, or 'unknown' when goodput is not running
    from its own git checkout (an installed copy inside some other repository must not borrow
    that repository's SHA)."""
    root = Path(__file__).resolve().parents[2]
    try:
        if Path(_git(root, "rev-parse", "--show-toplevel")).resolve() != root:
            return "unknown"
        dirty = _git(root, "status", "--porcelain")
        return _git(root, "rev-parse", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _git(root: Path, *args: str) -> str:
    command = ["git", "-C", str(root), *args]
    return subprocess.run(
        command, capture_output=True, text=True, check=True, timeout=10
    ).stdout.strip()
