"""Data-mix stages: one blend whose mixture changes at given global samples.

A stage is a file list and the global sample it starts at (``BlendStage``); stage 0 starts at
0 and stage ``k`` runs to the next one's start (the last to ``num_samples``). A plain blend is
one stage. Owns the checks of a stage schedule (``check_stages``), the staged interleave
(``interleave_stages``) and which stage a sample is in (``stage_of_sample``).

Invariants of ``interleave_stages``:

- each stage is interleaved on its own with its own weights over its own span (the C interleave,
  ``goodput.data.interleave``, written in place into the span), so every prefix of every stage
  keeps the ±1 bound: each of its corpora within one sample of ``weight × n``;
- a corpus's running number (``sample_index``) carries on across stages: stage ``k`` starts
  each corpus where the stages before it left it, so a sample is drawn again only once its
  corpus has gone through a whole epoch (``blend.corpus_order`` extends the order);
- corpus ids are the blend's (every stage's corpora, in order of first appearance), so stage
  0's corpora come first and a one-stage blend is exactly the unstaged one; peak memory is the
  two output arrays plus a bounded chunk.

It does not read file lists (``sources``) nor report the mixture (``mixture``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from goodput.data.interleave import interleave_into
from goodput.errors import GoodputError

# A schedule, not a per-step mixture: each stage costs a pass over its span, and [[data.stages]]
# a file list read at start; far past a real run's few mixtures.
MAX_STAGES = 64
_CHUNK = 1 << 20  # samples remapped or counted at once: 8 MiB of int64 scratch


@dataclass(frozen=True, slots=True)
class BlendStage:
    file_list: Path  # "weight path-prefix corpus" lines, as a plain blend's
    start_sample: int  # the global sample the stage starts at; stage 0 starts at 0


def check_stages(stages: Sequence[BlendStage], num_samples: int, step_samples: int) -> None:
    """Refuse a schedule the blend cannot honour: none or too many stages, a first stage not
    at 0, starts not increasing or past the run, a later stage's file list missing, a start
    inside a step of ``step_samples``."""
    if not 1 <= len(stages) <= MAX_STAGES:
        raise GoodputError.usage(
            "blend stages", f"{len(stages)} stages, not in [1, {MAX_STAGES}]", "merge stages"
        )
    if stages[0].start_sample != 0:
        raise GoodputError.usage(
            stage_name(0, stages[0]),
            f"starts at sample {stages[0].start_sample:,}",
            "start the first stage at sample 0",
        )
    for k in range(1, len(stages)):
        stage, previous = stages[k], stages[k - 1].start_sample
        if not previous < stage.start_sample < num_samples:
            raise GoodputError.usage(
                stage_name(k, stage),
                f"starts at sample {stage.start_sample:,}, not after stage {k - 1}'s start "
                f"({previous:,}) and before the run's end ({num_samples:,})",
                "list stages in order of their starts, each inside the run",
            )
        if not os.path.lexists(stage.file_list):  # stage 0's is read as a plain blend's
            raise GoodputError.usage(
                stage_name(k, stage), "the file list does not exist", "fix the path"
            )
        if stage.start_sample % step_samples:
            below = stage.start_sample - stage.start_sample % step_samples
            raise GoodputError.usage(
                stage_name(k, stage),
                f"starts at sample {stage.start_sample:,}, inside a step of "
                f"{step_samples:,} samples",
                f"start it at sample {below:,} or {below + step_samples:,}",
            )


def stage_name(k: int, stage: BlendStage) -> str:
    return f"stage {k} (file list {stage.file_list})"


def stage_spans(starts: Sequence[int], num_samples: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of every stage."""
    return list(zip(starts, [*starts[1:], num_samples], strict=True))


def stage_of_sample(starts: Sequence[int], sample: int) -> int:
    """The stage global sample ``sample`` belongs to (``starts`` increasing from 0)."""
    return int(np.searchsorted(np.asarray(starts), sample, side="right")) - 1


def interleave_stages(
    stage_weights: np.ndarray, starts: Sequence[int], num_samples: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(corpus_index, sample_index)`` of a staged blend. ``stage_weights[k, c]`` is corpus
    ``c``'s weight in stage ``k`` (0: not in it)."""
    num_corpora = stage_weights.shape[1]
    corpus_index = np.empty(num_samples, np.int16)
    sample_index = np.empty(num_samples, np.int64)
    cursor = np.zeros(num_corpora, np.int64)  # each corpus's samples drawn so far
    for weights, (start, stop) in zip(stage_weights, stage_spans(starts, num_samples), strict=True):
        present = np.flatnonzero(weights > 0)
        corpora, numbers = corpus_index[start:stop], sample_index[start:stop]
        interleave_into(weights[present], corpora, numbers)
        cursor += _to_blend_ids(corpora, numbers, present, cursor)
    return corpus_index, sample_index


def _to_blend_ids(
    corpora: np.ndarray, numbers: np.ndarray, present: np.ndarray, cursor: np.ndarray
) -> np.ndarray:
    """Turn a stage's own corpus ids and running counts into the blend's, in place, a chunk at
    a time; return how many samples of each corpus the stage drew."""
    counts = np.zeros(len(cursor), np.int64)
    identity = bool((present == np.arange(len(present))).all()) and not cursor.any()
    for first in range(0, len(corpora), _CHUNK):
        ids = corpora[first : first + _CHUNK]
        if not identity:  # stage 0 of any blend is already in the blend's numbering
            ids = present[ids]
            numbers[first : first + _CHUNK] += cursor[ids]
            corpora[first : first + _CHUNK] = ids
        counts += np.bincount(ids, minlength=len(cursor))
    return counts


def count_corpora(corpus_index: np.ndarray, num_corpora: int) -> np.ndarray:
    """Samples of each corpus in ``corpus_index`` (a memory map too), a chunk at a time."""
    counts = np.zeros(num_corpora, np.int64)
    for first in range(0, len(corpus_index), _CHUNK):
        counts += np.bincount(corpus_index[first : first + _CHUNK], minlength=num_corpora)
    return counts
