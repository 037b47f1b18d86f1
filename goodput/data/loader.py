"""Per-rank batches from a built blend: every rank memory-maps, no rank builds anything.

Global batch ``b`` is blended samples ``[b·G, (b+1)·G)``; DP rank ``r`` of ``R`` takes the
contiguous slice ``[b·G + r·G/R, b·G + (r+1)·G/R)``. The loader's whole state is the *global*
consumed-sample count plus the blend's fingerprint, so a run resumed at another DP size reads
exactly the same global sequence. A sample is ``seq_len + 1`` tokens: ``input_ids`` are the first
``seq_len``, ``labels`` the last ``seq_len``.

At open the loader refuses a blend whose manifest was edited, whose index arrays changed (each
one's dtype, length and — unless the caller has just checked them — sha256 against
``blend.json``: ``manifest.open_blend``) or whose shards
no longer match it, and — when resuming — one whose fingerprint differs from the checkpoint's,
naming the components that changed. The changes it accepts are a longer run (``num_samples``)
and data-mix stages that start at or after the checkpoint's consumed samples (appended, changed
or removed), provided the blend starts with the very samples the checkpoint consumed: the
loader state records their digest (``prefix``, see ``goodput.data.prefix``) and the stages'
starts, and the resume hashes the same prefix of the new blend. A change to a stage that has
started is refused naming it. The shards themselves are checked by size only, so start-up stays
cheap at any scale; ``goodput data verify`` re-hashes them too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from goodput.data import schema
from goodput.data.index_files import corpus_order_name, file_index_key, heldout_name
from goodput.data.manifest import changed_components, corpus_names, open_blend
from goodput.data.prefix import PrefixDigest
from goodput.data.shards import ShardReader
from goodput.data.stages import stage_of_sample
from goodput.errors import GoodputError

CHECKPOINT_STATE = "checkpoint data state"  # where a bad field is


class BlendedSamples:
    """Sample ``i`` of a blend as ``seq_len + 1`` int64 tokens; and the held-out samples of each
    corpus (``heldout``), when the blend holds some out."""

    def __init__(self, blend_dir: str | Path, *, hash_index: bool = True):
        self.directory = Path(blend_dir)
        self.manifest, arrays = open_blend(self.directory, hash_index=hash_index)
        self.seq_len: int = self.manifest["seq_len"]
        self.corpus_index = arrays["corpus_index.npy"]
        self.sample_index = arrays["sample_index.npy"]
        names = corpus_names(self.manifest)
        self.corpus_names: list[str] = names
        self.stage_starts: list[int] = [s["start_sample"] for s in self.manifest["stages"]]
        self.corpus_orders = [arrays[corpus_order_name(c)] for c in range(len(names))]
        self.heldout_numbers = [
            _heldout_numbers(self.directory, arrays, c, row["available"])
            for c, row in enumerate(self.manifest["report"]["corpora"])
        ]
        self.files: list[list[_File]] = [[] for _ in names]
        self.file_starts: list[np.ndarray] = []
        for shard in self.manifest["shards"]:
            self.files[names.index(shard["corpus"])].append(
                _File(shard, arrays, self.manifest["seed"], self.seq_len)
            )
        for corpus_files in self.files:
            counts = [f.num_samples for f in corpus_files]
            self.file_starts.append(np.cumsum([0, *counts])[:-1])

    def __len__(self) -> int:
        return len(self.corpus_index)

    def stage_of_sample(self, i: int) -> int:
        """The data-mix stage global sample ``i`` belongs to (0 in a blend of one stage)."""
        return stage_of_sample(self.stage_starts, i)

    def __getitem__(self, i: int) -> np.ndarray:
        corpus = int(self.corpus_index[i])
        return self._corpus_sample(
            corpus, int(self.corpus_orders[corpus][int(self.sample_index[i])])
        )

    def heldout(self, corpus: int, k: int) -> np.ndarray:
        """The ``k``-th held-out sample of corpus number ``corpus`` (``corpus_names``)."""
        return self._corpus_sample(corpus, int(self.heldout_numbers[corpus][k]))

    def _corpus_sample(self, corpus: int, within: int) -> np.ndarray:
        starts = self.file_starts[corpus]
        f = int(np.searchsorted(starts, within, side="right")) - 1
        return self.files[corpus][f].sample(within - int(starts[f]), self.seq_len)

    def identities(self, first: int, stop: int) -> bytes:
        """What samples ``[first, stop)`` read: each one's corpus (int16) and its number in
        that corpus's order (int64). With the shards, seed and seq_len fixed, they fix the
        tokens; unlike the tokens, they cost no shard read."""
        corpora = np.asarray(self.corpus_index[first:stop])
        numbers = np.asarray(self.sample_index[first:stop])
        within = np.empty(len(corpora), np.dtype("<i8"))
        for corpus in np.unique(corpora):
            chosen = corpora == corpus
            within[chosen] = self.corpus_orders[corpus][numbers[chosen]]
        return corpora.astype("<i2").tobytes() + within.tobytes()


def _heldout_numbers(
    directory: Path, arrays: dict[str, np.ndarray], corpus: int, available: int
) -> np.ndarray:
    """A corpus's held-out sample numbers (none when the blend holds none out), checked to be
    distinct, sorted numbers of its samples: the index only the loop's eval reads."""
    name = heldout_name(corpus)
    if name not in arrays:
        return np.zeros(0, np.int64)
    numbers = np.asarray(arrays[name])
    if len(numbers) and (
        numbers[0] < 0 or numbers[-1] >= available or (np.diff(numbers) <= 0).any()
    ):
        raise GoodputError(
            directory / name,
            f"is not a sorted list of distinct sample numbers below {available:,}",
            "delete the blend directory; the next start rebuilds it",
        )
    return numbers


class _File:
    """One shard of a blend, opened and checked against the run manifest."""

    def __init__(
        self, shard: dict[str, Any], arrays: dict[str, np.ndarray], seed: int, seq_len: int
    ):
        self.reader = ShardReader(shard["prefix"])
        rows_ok = not shard["packed"] or bool((self.reader.document_lengths == seq_len + 1).all())
        if (self.reader.num_tokens, len(self.reader), rows_ok) != (
            shard["num_tokens"],
            shard["num_documents"],
            True,
        ):
            raise GoodputError(
                shard["prefix"],
                "shard changed since the blend was built",
                "run `goodput data verify` and rebuild the blend",
            )
        self.num_samples: int = shard["num_samples"]
        self.packed: bool = shard["packed"]
        if not self.packed:
            self.order = arrays[file_index_key(shard["sha256_bin"], seed, "document_order.npy")]
            self.starts = arrays[file_index_key(shard["sha256_bin"], seed, "document_starts.npy")]

    def sample(self, s: int, seq_len: int) -> np.ndarray:
        if self.packed:
            return self.reader[s].astype(np.int64)
        out = np.empty(seq_len + 1, np.int64)
        position = s * seq_len
        k = int(np.searchsorted(self.starts, position, side="right")) - 1
        filled = 0
        while filled < len(out):  # a sample spans the tail of one document and the next ones
            document = int(self.order[k])
            skip = position + filled - int(self.starts[k])
            take = min(int(self.reader.document_lengths[document]) - skip, len(out) - filled)
            start = int(self.reader.document_offsets[document]) + skip
            out[filled : filled + take] = self.reader.tokens(start, start + take)
            filled += take
            k += 1
        return out


class DataLoader:
    """Yields this DP rank's ``(input_ids, labels)`` slice of each global batch."""

    def __init__(
        self,
        blend_dir: str | Path,
        *,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        hash_index: bool = True,
    ):
        """``hash_index=False`` checks the index arrays' headers and sizes but not their
        checksums: for ranks of a job whose blend one rank has just checked whole."""
        if global_batch_size < 1 or global_batch_size % dp_size:
            raise GoodputError.usage(
                "data loader",
                f"global batch size {global_batch_size} is not a "
                f"positive multiple of the data-parallel size {dp_size}",
                "choose a global batch size divisible by the DP size",
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.samples = BlendedSamples(blend_dir, hash_index=hash_index)
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.consumed_samples = 0
        self._prefix = PrefixDigest(self.samples.identities)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while self.consumed_samples + self.global_batch_size <= len(self.samples):
            first = self.consumed_samples + self.dp_rank * self.local_batch_size
            rows = np.stack([self.samples[i] for i in range(first, first + self.local_batch_size)])
            self.consumed_samples += self.global_batch_size
            tokens = torch.from_numpy(rows)
            yield tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        manifest = self.samples.manifest
        return {
            "consumed_samples": self.consumed_samples,
            "fingerprint": manifest["fingerprint"],
            "components": dict(manifest["components"]),
            "prefix": self._prefix.record(self.consumed_samples),
            "stage_starts": list(self.samples.stage_starts),
        }

    def load_state_dict(
        self, state: dict[str, Any], *, allow_data_change: bool = False, steps_left: int = 0
    ) -> None:
        """Resume at a global sample count; refuse different data unless explicitly allowed,
        or unless this blend differs from the checkpoint's only in its length and in stages not
        yet started (same first samples). The position must leave the ``steps_left`` batches
        the run still takes within the blend (a ``ValueError`` naming it otherwise: past the
        end of the blend it was saved with, it is damage). Checked whole before any change."""
        schema.check_loader_state(CHECKPOINT_STATE, state)
        prefix = state.get("prefix")  # absent from checkpoints of older goodput versions
        consumed = int(state["consumed_samples"])
        same_data = state["fingerprint"] == self.samples.manifest["fingerprint"]
        if not same_data and not allow_data_change:
            self._check_unstarted_change(state, prefix)
        needed = consumed + steps_left * self.global_batch_size
        if needed > len(self.samples):
            raise ValueError(
                f"loader.consumed_samples = {consumed:,} leaves the {steps_left:,} step(s) left "
                f"{needed - len(self.samples):,} samples past the end of the blend "
                f"({len(self.samples):,} samples, {self.global_batch_size:,} a step)"
            )
        # Hashed afresh unless carried on: after an allowed change it describes this blend.
        self._prefix = PrefixDigest(self.samples.identities)
        if same_data and prefix is not None:
            self._prefix.resume(consumed, prefix["chain"])
        self.consumed_samples = consumed

    def _check_unstarted_change(self, state: dict[str, Any], prefix: dict[str, str] | None) -> None:
        """Refuse, naming what changed, unless only the run's length and stages starting at or
        after ``consumed_samples`` did, and this blend's first ``consumed_samples`` samples are
        those the checkpoint consumed."""
        consumed = int(state["consumed_samples"])
        blend_json = self.samples.directory / "blend.json"
        fix = "resume with the blend the run started with, or allow the change explicitly"
        changed = changed_components(state["components"], self.samples.manifest["components"])
        started = self._started_changes(changed, state.get("stage_starts", []), consumed)
        differs = f"data fingerprint differs from the checkpoint's ({', '.join(changed)} changed)"
        if any(name != "num_samples" and _stage_number(name) is None for name in changed):
            raise GoodputError.usage(blend_json, differs, fix)  # stage 0, read from sample 0
        if started:
            restore = "restore that stage as it was, or resume with allow_data_change"
            raise GoodputError.usage(blend_json, f"{differs}: {started}", restore)
        if prefix is None:
            why = "the checkpoint, saved by an older goodput, records no digest of its samples"
        elif consumed > len(self.samples):
            why = f"the blend has {len(self.samples):,} samples, the checkpoint used {consumed:,}"
            fix = f"size the run for at least {consumed:,} samples (train.steps x global batch)"
        elif self._prefix.record(consumed)["sha256"] != prefix["sha256"]:
            why = f"this blend's first {consumed:,} samples are not those the checkpoint consumed"
        else:
            return
        raise GoodputError.usage(blend_json, f"{differs}: {why}", fix)

    def _started_changes(self, changed: list[str], old_starts: list[int], consumed: int) -> str:
        """Why the changed ``stage k`` components touch data already read ("" when they do
        not): a stage that had started by ``consumed`` in the checkpoint's blend or starts
        before it in this one."""
        stages = self.samples.manifest["stages"]
        for k in filter(None, map(_stage_number, changed)):
            starts = [self.samples.stage_starts[k]] if k < len(stages) else []
            if k < len(old_starts):
                starts.append(old_starts[k])
            if not starts:  # removed, and the checkpoint says not where it began: assume read
                starts.append(0)
            if min(starts) < consumed:
                what = f"file list {stages[k]['file_list']}" if k < len(stages) else "removed"
                return (
                    f"stage {k} ({what}) started at sample {min(starts):,} and the checkpoint "
                    f"has consumed {consumed:,}; only a stage not yet started may change"
                )
        return ""


def _stage_number(component: str) -> int | None:
    """``k`` of a fingerprint component ``stage k`` (k >= 1: stage 0's are the blend's own);
    None for any other name, as a checkpoint's hostile one would be."""
    match = re.fullmatch(r"stage ([1-9][0-9]{0,4})", component)
    return int(match.group(1)) if match else None
