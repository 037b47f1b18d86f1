"""Fuzz the readers of the data part's JSON files — dataset manifests, tokenize part records,
``blend.json`` — and of a blend's ``.npy`` index arrays: random values and mutations of valid
files give a checked manifest (and a blend that opens) or a GoodputError; never a KeyError,
TypeError or numpy error later on."""

import io
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from goodput.data.blend import BlendSpec, BlendStage, build_blend
from goodput.data.index_files import INT16, IndexFile, load_array
from goodput.data.loader import BlendedSamples
from goodput.data.manifest import read_dataset_manifest, read_part_record, read_run_manifest
from goodput.data.shards import ShardWriter
from goodput.testing import fuzz

json_values = fuzz.json_values(
    "ab" * 32, "../x", "web_00000", "goodput.blend/1", "goodput.shards/1"
)


@given(value=json_values, reader=st.sampled_from([read_dataset_manifest, read_part_record]))
def test_random_json(tmp_path, value, reader):
    path = tmp_path / "x.manifest.json"
    path.write_text(json.dumps(value))
    fuzz.result_or_refusal(reader, path)
    fuzz.result_or_refusal(read_run_manifest, path)


@pytest.fixture(scope="module")
def built_blend(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    for name, seed in (("a", 1), ("b", 2)):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, 40, 30)
        writer = ShardWriter(root / name, np.dtype(np.uint16))
        writer.add_documents(rng.integers(1, 100, int(lengths.sum()), dtype=np.uint16), lengths)
        writer.finish()
    (root / "list.txt").write_text("1 a a\n2 b b\n")
    spec = BlendSpec(
        stages=(BlendStage(root / "list.txt", 0),),
        seq_len=8,
        num_samples=40,
        seed=1,
        cache=root / "cache",
    )
    directory, _ = build_blend(spec)
    return directory, (directory / "blend.json").read_text()


def paths_of(value, prefix=()):
    """Every (path, value) inside a JSON value."""
    yield prefix, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths_of(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from paths_of(item, (*prefix, i))


@given(data=st.data())
def test_mutated_blend_json_opens_or_is_refused(built_blend, data):
    directory, original = built_blend
    manifest = json.loads(original)
    for _ in range(data.draw(st.integers(1, 3))):
        places = [path for path, _ in paths_of(manifest) if path]
        path = data.draw(st.sampled_from(places))
        parent = manifest
        for key in path[:-1]:
            parent = parent[key]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(json_values | st.integers(0, 64) | st.booleans())
    (directory / "blend.json").write_text(json.dumps(manifest))
    try:
        samples = fuzz.result_or_refusal(BlendedSamples, directory)
        if samples is not None:  # what is left unchecked must still read every sample
            for i in range(len(samples)):
                assert len(samples[i]) == samples.seq_len + 1
    finally:
        (directory / "blend.json").write_text(original)


def npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


VALID_NPY = npy_bytes(np.arange(16, dtype=np.int16))


@given(
    data=st.binary(max_size=200)
    | st.builds(lambda cut: VALID_NPY[:cut], st.integers(0, len(VALID_NPY)))
    | st.builds(
        lambda at, byte: VALID_NPY[:at] + bytes([byte]) + VALID_NPY[at + 1 :],
        st.integers(0, len(VALID_NPY) - 1),
        st.integers(0, 255),
    )
    | st.builds(npy_bytes, st.sampled_from([np.array([None, 1], dtype=object), np.zeros((4, 4))]))
)
def test_npy_index_arrays(tmp_path, data):
    path = tmp_path / "corpus_index.npy"
    path.write_bytes(data)
    array = fuzz.result_or_refusal(load_array, IndexFile(path, (INT16,), 16))
    if array is not None:
        assert array.dtype == INT16 and array.shape == (16,)
        array.tolist()  # every byte mapped is readable
