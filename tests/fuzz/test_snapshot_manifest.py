"""Fuzz the in-memory checkpoint's manifest reader (``snapshot.format.parse_manifest`` and
``snapshot.files.read_manifest``): a restart reads manifests left by earlier processes and
received from partner ranks, and any of them may be damaged or hostile.

Property: any bytes, any JSON value, a valid manifest with a field replaced, removed or added,
or its bytes flipped or cut: a ``Manifest`` that is consistent (it serialises back to one that
parses equal, its offsets packed inside its payload, one digest per chunk), or a one-line
``GoodputError`` naming where it came from; never another exception.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from goodput.checkpoint.snapshot.files import read_manifest
from goodput.checkpoint.snapshot.format import (
    ALIGN,
    DTYPES,
    Manifest,
    chunk_count,
    manifest_bytes,
    parse_manifest,
)
from goodput.testing.fuzz import json_values, result_or_refusal
from goodput.testing.snapshots import sample_manifest

WHERE = "held-00001.slot-0.json"


@functools.cache
def _valid() -> bytes:
    manifest, _ = sample_manifest()
    return manifest_bytes(manifest)


def _check(data: bytes) -> None:
    manifest = result_or_refusal(parse_manifest, data, WHERE)
    if manifest is None:
        return
    assert isinstance(manifest, Manifest)
    assert parse_manifest(manifest_bytes(manifest), WHERE) == manifest
    assert len(manifest.chunks) == chunk_count(manifest.payload_bytes, manifest.chunk_bytes)
    end = 0
    for entry in manifest.tensors:
        assert entry.offset % ALIGN == 0 and entry.offset >= end and entry.dtype in DTYPES
        end = entry.offset + entry.nbytes
    assert end <= manifest.payload_bytes
    assert 0 <= manifest.rank < manifest.world_size


@given(data=st.binary(max_size=512))
def test_random_bytes(data):
    _check(data)


@given(value=json_values("goodput-snapshot", 1, "0123456789abcdef", "a" * 64))
def test_any_json_value(value):
    _check(json.dumps(value).encode())


_FIELDS = sorted(json.loads(_valid()))
_PATHS = st.one_of(
    st.tuples(st.sampled_from(_FIELDS)),
    st.tuples(st.just("tensors"), st.integers(0, 11), st.integers(0, 4)),
    st.tuples(st.just("tensors"), st.integers(0, 11), st.just(2), st.integers(0, 1)),
    st.tuples(st.just("chunks"), st.integers(0, 3)),
    st.tuples(st.just("hosts_shape"), st.integers(0, 1)),
    st.tuples(st.just("train_state"), st.sampled_from(["step", "loader", "world_size", "x"])),
)
_VALUES = json_values(0, 64, 2**40, -1, "bfloat16", "bool", "a" * 64, [], {})


def _edit(raw: Any, path: tuple[Any, ...], value: Any, remove: bool) -> None:
    *parents, last = path
    for key in parents:
        raw = raw[key]
    if isinstance(raw, list):
        last = min(last, len(raw) - 1)
    if remove:
        del raw[last]
    else:
        raw[last] = value


@given(edits=st.lists(st.tuples(_PATHS, _VALUES, st.booleans()), min_size=1, max_size=3))
def test_a_valid_manifest_with_fields_replaced_or_removed(edits):
    raw = json.loads(_valid())
    for path, value, remove in edits:
        try:
            _edit(raw, path, value, remove)
        except (KeyError, IndexError, TypeError):  # an earlier edit removed or replaced a parent
            continue
    _check(json.dumps(raw).encode())


@given(
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_a_valid_manifest_damaged(flips, cut):
    data = bytearray(_valid())
    for offset, value in flips:
        data[offset % len(data)] = value
    _check(bytes(data if cut is None else data[: cut % (len(data) + 1)]))


@given(data=st.one_of(st.binary(max_size=256), st.just(_valid())))
def test_read_manifest_of_any_file(data):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / WHERE
        path.write_bytes(data)
        result = result_or_refusal(read_manifest, path)
        assert result is None or isinstance(result, Manifest)
