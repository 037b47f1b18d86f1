"""Fuzz the ``.bin/.idx`` reader: random headers, random bytes and mutations of a valid pair give
a reader whose every document can be read, or a GoodputError; never a numpy error or a
MemoryError (a header's counts are checked against the file's size before anything is mapped)."""

import struct

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from goodput.data.shards import HEADER, MAGIC, ShardReader, ShardWriter
from goodput.errors import GoodputError

DOCUMENTS = [np.array([5, 6, 7, 0]), np.array([9, 0]), np.array([65535, 1, 2, 0])]


def valid_pair(prefix):
    writer = ShardWriter(prefix, np.dtype(np.uint16))
    writer.add_documents(np.concatenate(DOCUMENTS).astype(np.uint16), np.array([4, 2, 4]))
    writer.finish()
    return (prefix.with_suffix(".idx").read_bytes(), prefix.with_suffix(".bin").read_bytes())


def read_all_or_refuse(prefix):
    try:
        reader = ShardReader(prefix)
    except GoodputError as error:
        assert "\n" not in error.render()
        return
    total = sum(len(reader[i]) for i in range(len(reader)))
    assert total <= reader.num_tokens or len(reader) == 0


def write(prefix, idx, bin_):
    prefix.with_suffix(".idx").write_bytes(idx)
    prefix.with_suffix(".bin").write_bytes(bin_)


counts = st.integers(0, 2**64 - 1) | st.integers(0, 16)


@given(
    version=st.integers(0, 2**64 - 1) | st.just(1),
    code=st.integers(0, 255) | st.sampled_from([1, 2, 3, 4, 5, 8]),
    num_sequences=counts,
    num_boundaries=counts,
    body=st.binary(max_size=256),
    bin_=st.binary(max_size=64),
)
def test_headers(tmp_path, version, code, num_sequences, num_boundaries, body, bin_):
    prefix = tmp_path / "s"
    header = HEADER.pack(MAGIC, version, code, num_sequences, num_boundaries)
    write(prefix, header + body, bin_)
    read_all_or_refuse(prefix)


@given(idx=st.binary(max_size=200), bin_=st.binary(max_size=64))
def test_random_bytes(tmp_path, idx, bin_):
    write(tmp_path / "s", idx, bin_)
    read_all_or_refuse(tmp_path / "s")


@given(data=st.data())
def test_mutated_valid_pairs(tmp_path, data):
    prefix = tmp_path / "s"
    idx, bin_ = valid_pair(prefix)
    idx, bin_ = bytearray(idx), bytearray(bin_)
    for _ in range(data.draw(st.integers(1, 4))):
        target = data.draw(st.sampled_from([idx, bin_]))
        position = data.draw(st.integers(0, len(target)))
        action = data.draw(st.sampled_from(["flip", "cut", "insert", "word"]))
        if action == "flip" and position < len(target):
            target[position] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "cut":
            del target[position:]
        elif action == "insert":
            target[position:position] = data.draw(st.binary(min_size=1, max_size=8))
        elif action == "word" and position + 8 <= len(target):
            target[position : position + 8] = struct.pack("<Q", data.draw(counts))
    write(prefix, bytes(idx), bytes(bin_))
    read_all_or_refuse(prefix)
