"""Blend interleave: which corpus each sample of a blended run comes from, in order.

Owns the sample order of a mixture: given corpus weights and a length N, a deterministic sequence of
corpus ids (``corpus_index``, int16) and, per position, how many samples of that corpus came before
(``sample_index``, int64). The work is done in C (``_interleave.c``, built by ``pip install -e .``
and loaded with ctypes), since N reaches 10^8 and more.

Invariants of ``build_blend_index`` (earliest-deadline-first over per-corpus windows):

- for every prefix of n samples and every corpus d, ``|count_d(n) - w_d * n| <= 1``, so every
  window of the run, and in particular every global batch, is within 2 samples of its mixture;
- deterministic, and prefix-stable: a longer run extends a shorter one sample for sample, so
  resuming with a larger N changes nothing already trained on;
- peak memory is the two output arrays (10 bytes a sample) plus O(corpora) scratch.

``greedy_blend_index`` is the classic largest-deficit-first greedy (as in Megatron-LM), kept only as
the baseline the benchmark compares against; ``max_batch_deviation`` is the measure both are judged
by.

Does not: read, shuffle or epoch corpora (``sample_index`` is a running count; mapping it to a
document is ``goodput.data.blend``'s job), nor cache indices on disk.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import math
import operator
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from goodput.errors import GoodputError

MAX_CORPORA = 32767  # corpus ids are stored as int16
# The C side treats slots from 2**47 on as "never"; stay well clear of it.
MAX_SAMPLES = 1 << 46
# Cells (batches x corpora) counted at once by max_batch_deviation: 32 MiB of int64.
_CHUNK_CELLS = 1 << 22

_EDF = "goodput_edf_interleave"
_GREEDY = "goodput_greedy_interleave"

WeightsLike = Sequence[float] | np.ndarray


def normalise_weights(weights: WeightsLike) -> np.ndarray:
    """Checks corpus weights and scales them to sum to 1 (float64, contiguous).

    Raises ValueError unless ``weights`` is a non-empty 1-D sequence of at most ``MAX_CORPORA``
    finite numbers, each > 0.
    """
    array = np.asarray(weights, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"blend weights must be a non-empty 1-D sequence, got shape {array.shape}")
    if array.size > MAX_CORPORA:
        raise ValueError(f"at most {MAX_CORPORA} corpora can be blended, got {array.size}")
    bad = np.flatnonzero(~np.isfinite(array) | (array <= 0))
    if bad.size:
        raise ValueError(
            f"blend weights must be finite and > 0; weight {bad[0]} is {array[bad[0]]}"
            f" ({bad.size} bad in all)"
        )
    # Scaling by the largest first keeps the sum from overflowing; fsum keeps it exact to the ulp.
    scaled = array / array.max()
    normalised = scaled / math.fsum(scaled.tolist())
    if not np.all(normalised > 0):
        raise ValueError("blend weights span too wide a range: the smallest rounds to 0")
    return np.ascontiguousarray(normalised)


def build_blend_index(weights: WeightsLike, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Interleaves corpora so every prefix honours ``weights`` to within one sample per corpus.

    ``weights`` need not sum to 1. Returns ``(corpus_index, sample_index)`` of length
    ``num_samples``: int16 corpus ids, and int64 running counts (sample i is the
    ``sample_index[i]``-th sample drawn from corpus ``corpus_index[i]``).
    """
    normalised = normalise_weights(weights)
    corpus_index, sample_index = _outputs(_check_num_samples(num_samples))
    _run(_EDF, normalised, corpus_index, sample_index)
    return corpus_index, sample_index


def interleave_into(weights: WeightsLike, corpus_out: np.ndarray, sample_out: np.ndarray) -> None:
    """``build_blend_index`` written into ``corpus_out`` (int16) and ``sample_out`` (int64),
    contiguous arrays of one length: a slice of a longer index (a stage's span,
    ``goodput.data.stages``) is filled in place, with no second copy of it in memory."""
    if not (
        corpus_out.dtype == np.int16
        and sample_out.dtype == np.int64
        and corpus_out.shape == sample_out.shape == (corpus_out.size,)
        and corpus_out.flags.c_contiguous
        and sample_out.flags.c_contiguous
        and corpus_out.flags.writeable
        and sample_out.flags.writeable
    ):
        raise ValueError("interleave_into needs writable contiguous int16/int64 1-D outputs")
    _check_num_samples(corpus_out.size)
    _run(_EDF, normalise_weights(weights), corpus_out, sample_out)


def greedy_blend_index(weights: WeightsLike, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """The baseline: at each sample, the corpus furthest behind ``w_d * max(i, 1)``; O(N * D).

    Same arguments and return as ``build_blend_index``; no per-prefix bound is promised.
    """
    normalised = normalise_weights(weights)
    corpus_index, sample_index = _outputs(_check_num_samples(num_samples))
    _run(_GREEDY, normalised, corpus_index, sample_index)
    return corpus_index, sample_index


def max_batch_deviation(
    corpus_index: np.ndarray,
    weights: WeightsLike,
    batch_size: int,
    lookup: np.ndarray | None = None,
) -> np.ndarray:
    """Per corpus, the worst ``|count in batch - w * batch_size|`` over aligned full batches.

    Batches are ``[k * batch_size, (k + 1) * batch_size)``; a trailing partial batch is left out
    (all zeros if there is no full batch). Counts a bounded chunk of batches at a time, so memory
    stays small at any length. ``lookup`` maps the ids in ``corpus_index`` to positions in
    ``weights`` (a stage's corpora among a blend's, ``goodput.data.stages``), -1 for none.
    """
    normalised = normalise_weights(weights)
    batch_size = operator.index(batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    corpus_index = np.asarray(corpus_index)
    num_corpora = normalised.size
    expected = normalised * batch_size
    worst = np.zeros(num_corpora)
    num_batches = corpus_index.size // batch_size
    batches_per_chunk = max(1, min(_CHUNK_CELLS // num_corpora, _CHUNK_CELLS // batch_size))
    for first in range(0, num_batches, batches_per_chunk):
        count = min(batches_per_chunk, num_batches - first)
        chunk = corpus_index[first * batch_size : (first + count) * batch_size]
        if lookup is not None:
            chunk = lookup[chunk]
        if chunk.min() < 0 or chunk.max() >= num_corpora:
            raise ValueError(f"corpus_index has ids outside [0, {num_corpora}) for these weights")
        # One bincount over (batch, corpus) cells counts every batch of the chunk at once.
        cells = chunk.reshape(count, batch_size).astype(np.int64)
        cells += np.arange(count, dtype=np.int64)[:, None] * num_corpora
        per_batch = np.bincount(cells.ravel(), minlength=count * num_corpora)
        per_batch = per_batch.reshape(count, num_corpora)
        np.maximum(worst, np.abs(per_batch - expected).max(axis=0), out=worst)
    return worst


def _check_num_samples(num_samples: int) -> int:
    count = operator.index(num_samples)
    if not 0 <= count <= MAX_SAMPLES:
        raise ValueError(f"num_samples must be in [0, {MAX_SAMPLES}], got {count}")
    return count


def _outputs(num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    return np.empty(num_samples, dtype=np.int16), np.empty(num_samples, dtype=np.int64)


def _run(
    symbol: str, weights: np.ndarray, corpus_index: np.ndarray, sample_index: np.ndarray
) -> int:
    """Calls one C interleave on checked weights into checked outputs; returns its status
    (EDF: fallback slots)."""
    status = getattr(_library(), symbol)(
        weights.ctypes.data,
        weights.size,
        corpus_index.size,
        corpus_index.ctypes.data,
        sample_index.ctypes.data,
    )
    if status < 0:
        raise MemoryError(f"{symbol}: could not allocate scratch for {weights.size} corpora")
    return int(status)


@functools.cache
def _library() -> ctypes.CDLL:
    """Loads the compiled ``_interleave`` beside this file (cached; a failure is retried)."""
    here = Path(__file__).resolve().parent
    candidates = [
        here / f"_interleave{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES
    ]
    path = next((candidate for candidate in candidates if candidate.is_file()), None)
    if path is None:
        raise GoodputError(
            here / "_interleave.c",
            "the compiled blend interleave is missing (no _interleave*.so beside it)",
            "build it with `pip install -e .` (or `make test`) from the repository root",
        )
    library = ctypes.CDLL(str(path))
    for symbol in (_EDF, _GREEDY):
        function = getattr(library, symbol)
        function.argtypes = [
            ctypes.c_void_p,  # const double *weight
            ctypes.c_int32,  # num_corpora
            ctypes.c_int64,  # num_samples
            ctypes.c_void_p,  # int16_t *corpus_out
            ctypes.c_void_p,  # int64_t *sample_out
        ]
        function.restype = ctypes.c_int64
    return library
