"""Fuzz the stages of a staged ``blend.json``: a mutated or dropped field of any stage (its
start, file list, weights, report rows) gives a blend that opens and reads every sample, or a
GoodputError naming the file; never a KeyError, IndexError or numpy error later on."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from goodput.data.blend import BlendSpec, BlendStage, build_blend
from goodput.data.loader import BlendedSamples
from goodput.data.shards import ShardWriter
from goodput.testing import fuzz

json_values = fuzz.json_values("ab" * 32, "a", "b", "c", "stage 1")


@pytest.fixture(scope="module")
def staged_blend(tmp_path_factory):
    root = tmp_path_factory.mktemp("staged")
    for seed, name in enumerate("abc"):
        lengths = np.random.default_rng(seed).integers(1, 40, 30)
        writer = ShardWriter(root / name, np.dtype(np.uint16))
        writer.add_documents(np.ones(lengths.sum(), np.uint16), lengths)
        writer.finish()
    (root / "s0.txt").write_text("1 a a\n2 b b\n")
    (root / "s1.txt").write_text("1 c c\n1 a a\n")
    spec = BlendSpec(
        stages=(BlendStage(root / "s0.txt", 0), BlendStage(root / "s1.txt", 24)),
        seq_len=8,
        num_samples=48,
        seed=1,
        cache=root / "cache",
        step_samples=8,
    )
    directory, _ = build_blend(spec)
    return directory, (directory / "blend.json").read_text()


def paths_under(value, prefix):
    """Every path inside the JSON value ``value`` found at ``prefix``."""
    yield prefix
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        yield from paths_under(item, (*prefix, key))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_mutated_stage_opens_or_is_refused(staged_blend, data):
    directory, original = staged_blend
    manifest = json.loads(original)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(list(paths_under(manifest.get("stages"), ("stages",)))))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        if data.draw(st.booleans()) and isinstance(parent, dict) and path[-1] in parent:
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(json_values | st.integers(-1, 64) | st.booleans())
    (directory / "blend.json").write_text(json.dumps(manifest))
    try:
        samples = fuzz.result_or_refusal(BlendedSamples, directory)
        if samples is not None:
            for i in range(len(samples)):
                assert len(samples[i]) == samples.seq_len + 1
            assert samples.stage_starts[0] == 0
            assert all(samples.stage_of_sample(s) == k for k, s in enumerate(samples.stage_starts))
    finally:
        (directory / "blend.json").write_text(original)
