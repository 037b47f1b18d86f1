"""Prefix stability of a blend, property-tested: for any weights, seed and lengths N < M, the
blend of N samples is the first N samples of the blend of M — the interleave, each corpus's
order and the tokens read — so a lengthened run's loader accepts the shorter run's state."""

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from goodput.data.blend import BlendSpec, BlendStage, build_blend, corpus_order
from goodput.data.interleave import build_blend_index
from goodput.data.loader import BlendedSamples, DataLoader
from goodput.data.shards import ShardWriter

weights = st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=40)
lengths = st.tuples(st.integers(0, 5000), st.integers(0, 5000)).map(sorted)


@given(weights=weights, lengths=lengths)
def test_the_interleave_of_n_samples_starts_that_of_more(weights, lengths):
    short, long = lengths
    short_corpus, short_sample = build_blend_index(weights, short)
    long_corpus, long_sample = build_blend_index(weights, long)
    np.testing.assert_array_equal(long_corpus[:short], short_corpus)
    np.testing.assert_array_equal(long_sample[:short], short_sample)


@given(
    available=st.integers(1, 300),
    lengths=st.tuples(st.integers(0, 1000), st.integers(0, 1000)).map(sorted),
    seed=st.integers(0, 2**32),
)
def test_a_corpus_order_of_n_samples_starts_that_of_more(available, lengths, seed):
    short, long = lengths
    longer = corpus_order("web", available, long, seed)
    np.testing.assert_array_equal(longer[:short], corpus_order("web", available, short, seed))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, 40, 25)
        writer = ShardWriter(root / name, np.dtype(np.uint16))
        writer.add_documents(rng.integers(1, 100, int(lengths.sum()), dtype=np.uint16), lengths)
        writer.finish()
    return root


@given(
    weights=st.lists(st.floats(0.01, 1.0), min_size=3, max_size=3),
    lengths=st.tuples(st.integers(1, 300), st.integers(1, 300)).map(sorted),
    seed=st.integers(0, 2**32),
)
def test_a_blend_of_n_samples_starts_that_of_more(shards, weights, lengths, seed):
    short, long = lengths
    file_list = shards / "list.txt"
    file_list.write_text("".join(f"{w!r} {n} {n}\n" for w, n in zip(weights, "abc", strict=True)))
    with tempfile.TemporaryDirectory() as cache:

        def blend(num_samples):
            spec = BlendSpec(
                stages=(BlendStage(file_list, 0),),
                seq_len=8,
                num_samples=num_samples,
                seed=seed,
                cache=Path(cache),
            )
            return build_blend(spec)[0]

        shorter, longer = BlendedSamples(blend(short)), BlendedSamples(blend(long))
        assert longer.identities(0, short) == shorter.identities(0, short)
        for i in range(0, short, 7):
            np.testing.assert_array_equal(longer[i], shorter[i])
        loader = DataLoader(shorter.directory, global_batch_size=1, dp_rank=0, dp_size=1)
        loader.consumed_samples = short
        lengthened = DataLoader(longer.directory, global_batch_size=1, dp_rank=0, dp_size=1)
        lengthened.load_state_dict(loader.state_dict())  # accepted: only the length changed
        assert lengthened.consumed_samples == short
