"""Fuzz the readers of a checkpoint's files: ``.metadata`` (a pickle), ``checksums.json``,
``train_state.json`` and the per-rank RNG JSON. Each gives a valid result or a GoodputError."""

import json
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from goodput.checkpoint.checksums import read_checksums
from goodput.checkpoint.load import check_train_state
from goodput.checkpoint.metadata import read_metadata
from goodput.checkpoint.state import rng_state, set_rng_state
from goodput.testing import fuzz

json_values = fuzz.json_values()


def valid_metadata_pickle() -> bytes:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    size = torch.Size([4, 2])
    tensor = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        size,
        [ChunkStorageMetadata(torch.Size([0, 0]), size)],
    )
    index = MetadataIndex("model.w", torch.Size([0, 0]), 0)
    return pickle.dumps(
        Metadata({"model.w": tensor}, storage_data={index: _StorageInfo("__0_0.distcp", 0, 32)})
    )


VALID_METADATA = valid_metadata_pickle()


def test_the_valid_metadata_reads(tmp_path):
    (tmp_path / ".metadata").write_bytes(VALID_METADATA)
    assert list(read_metadata(tmp_path).state_dict_metadata) == ["model.w"]


@given(data=st.binary(max_size=300))
def test_random_bytes_as_metadata(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("m")
    (directory / ".metadata").write_bytes(data)
    fuzz.result_or_refusal(read_metadata, directory)


@given(
    position=st.integers(min_value=0, max_value=len(VALID_METADATA) - 1),
    value=st.integers(min_value=0, max_value=255),
    cut=st.integers(min_value=1, max_value=len(VALID_METADATA)),
)
def test_mutated_metadata(tmp_path_factory, position, value, cut):
    directory = tmp_path_factory.mktemp("m")
    data = bytearray(VALID_METADATA)
    data[position] = value
    (directory / ".metadata").write_bytes(bytes(data[:cut]))
    metadata = fuzz.result_or_refusal(read_metadata, directory)
    if metadata is not None:  # what got through is checkpoint metadata, naming only DCP files
        assert isinstance(metadata, Metadata)
        assert all(i.relative_path.endswith(".distcp") for i in metadata.storage_data.values())


@given(value=json_values)
def test_checksums_json(tmp_path_factory, value):
    directory = tmp_path_factory.mktemp("c")
    (directory / "checksums.json").write_text(json.dumps(value))
    digests = fuzz.result_or_refusal(read_checksums, directory)
    if digests is not None:
        assert all(".." not in name.split("/") for name in digests)


@given(files=st.dictionaries(st.text(max_size=30), st.text(max_size=70), max_size=3))
def test_checksums_json_names(tmp_path_factory, files):
    directory = tmp_path_factory.mktemp("c")
    recorded = {"algorithm": "sha256", "files": files}
    (directory / "checksums.json").write_text(json.dumps(recorded))
    digests = fuzz.result_or_refusal(read_checksums, directory)
    for name in digests or {}:
        assert not name.startswith("/") and ".." not in name.split("/")


@given(value=json_values)
def test_train_state(value):
    fuzz.result_or_refusal(check_train_state, value, Path("train_state.json"))


def leaves(value, path=()):
    if isinstance(value, dict):
        for key, child in value.items():
            yield from leaves(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from leaves(child, (*path, index))
    else:
        yield path


def replaced(value, path, new):
    if not path:
        return new
    copy = list(value) if isinstance(value, list) else dict(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy


SAVED_RNG = json.loads(json.dumps(rng_state(torch.device("cpu"))))
RNG_LEAVES = list(leaves({k: v for k, v in SAVED_RNG.items() if k != "python"}))
RNG_LEAVES += [("python", 0), ("python", 2), ("python", 1, 0), ("python", 1, 624)]


@pytest.fixture(autouse=True)
def keep_the_rngs():
    state = rng_state(torch.device("cpu"))
    yield
    set_rng_state(state, torch.device("cpu"), Path("saved"))


@given(path=st.sampled_from(RNG_LEAVES), new=json_values)
def test_rng_state_with_one_value_replaced(path, new):
    broken = replaced(SAVED_RNG, path, new)
    fuzz.result_or_refusal(set_rng_state, broken, torch.device("cpu"), Path("rng/rank-00000.json"))


@given(value=json_values)
def test_rng_state_of_random_json(value):
    fuzz.result_or_refusal(set_rng_state, value, torch.device("cpu"), Path("rng/rank-00000.json"))
