"""Pinning: dataset manifests, the run manifest of a blend, fingerprints and verification.

A *dataset manifest* (``<name>.manifest.json``, written last by ``goodput data tokenize``) lists
every shard with its sha256, counts and dtype, the tokenizer's identity and the inputs. A *run
manifest* (``blend.json`` in a blend directory) pins what a training run reads: tokenizer
identity, every shard's checksum, corpus weights, seed, seq_len, num_samples, plus the goodput
version and git SHA that built it. Its fingerprint is a hash of per-component hashes
(``components``), so a mismatch can name *what* changed, not only that something did. The
version and git SHA are recorded but not fingerprinted: they do not change the data.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from goodput.data.shards import bin_path, idx_path
from goodput.errors import GoodputError
from goodput.io import sha256_file, sha256_json

SHARDS_FORMAT = "goodput.shards/1"
RUN_FORMAT = "goodput.blend/1"
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


def manifest_path(directory: Path, name: str) -> Path:
    return Path(directory) / f"{name}.manifest.json"


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GoodputError(path, "missing", "check the path") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GoodputError(
            path,
            f"not valid JSON: {exc}",
            "the file is damaged; rebuild it with the command that wrote it",
        ) from None
    if not isinstance(value, dict):
        raise GoodputError(path, "expected a JSON object", "rebuild it")
    return value


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
                for candidate in sorted(directory.glob("*.manifest.json"))
                for manifest in [read_json(candidate)]
                for shard in manifest.get("shards", [])
            }
        return self._by_directory[directory].get(prefix.name)


def verify_dataset(manifest_file: Path) -> list[str]:
    """Re-hash every shard of a dataset manifest; return one line per problem (empty = ok)."""
    manifest = read_json(manifest_file)
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
        elif sha256_file(path) != expected:
            problems.append(f"{path}: checksum mismatch (the file changed since it was pinned)")
    return problems


def fingerprint(pinned: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """(fingerprint, per-component hashes) of the fingerprinted fields of a run manifest."""
    components = {key: sha256_json(_content(key, pinned[key]))[:16] for key in FINGERPRINTED}
    return sha256_json(components), components


def _content(key: str, value: Any) -> Any:
    """What identifies a component's content: moving the data or the tokenizer file changes
    paths, not the fingerprint."""
    if key == "shards":
        return [[s["corpus"], s["sha256_bin"], s["sha256_idx"]] for s in value]
    if key == "tokenizer" and value:
        return [value["sha256"], value["library"]]
    return value


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


def verify_run(path: Path) -> list[str]:
    """Full check of a run manifest: its fingerprint, every shard's checksum, the tokenizer."""
    manifest = read_json(path)
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
        and sha256_file(tokenizer_file) != tokenizer["sha256"]
    ):
        problems.append(f"{tokenizer_file}: tokenizer file changed since it was pinned")
    return problems


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
