"""The .bin/.idx format, checked against bytes laid out by hand from Megatron's MMIDIDX rules
(magic, <Q version, <B dtype code, <Q sequences, <Q document boundaries, int32 lengths,
int64 byte pointers, int64 document indices) — not against our own writer."""

import re
import struct

import numpy as np
import pytest

from goodput.data.shards import ShardReader, ShardWriter, token_dtype
from goodput.errors import GoodputError


def megatron_idx(lengths, document_indices, dtype_code, itemsize):
    pointers, offset = [], 0
    for length in lengths:
        pointers.append(offset)
        offset += length * itemsize
    return (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", dtype_code)
        + struct.pack("<Q", len(lengths))
        + struct.pack("<Q", len(document_indices))
        + struct.pack(f"<{len(lengths)}i", *lengths)
        + struct.pack(f"<{len(pointers)}q", *pointers)
        + struct.pack(f"<{len(document_indices)}q", *document_indices)
    )


def write_shard(prefix, docs, dtype):
    writer = ShardWriter(prefix, np.dtype(dtype))
    writer.add_documents(np.concatenate(docs).astype(dtype), np.array([len(d) for d in docs]))
    return writer.finish()


def test_our_files_are_byte_identical_to_the_format_rules(tmp_path):
    docs = [np.array([5, 6, 7, 0]), np.array([9, 0]), np.array([65535, 1, 2, 0])]
    sha = write_shard(tmp_path / "ours", docs, np.uint16)
    idx = (tmp_path / "ours.idx").read_bytes()
    assert idx == megatron_idx([4, 2, 4], [0, 1, 2, 3], dtype_code=8, itemsize=2)
    assert (tmp_path / "ours.bin").read_bytes() == np.concatenate(docs).astype("<u2").tobytes()
    import hashlib

    assert sha == hashlib.sha256((tmp_path / "ours.bin").read_bytes()).hexdigest()


def test_reader_reads_a_foreign_int32_file_with_multi_sequence_documents(tmp_path):
    # Megatron --split-sentences: document 0 = sequences 0-1, document 1 = sequence 2.
    tokens = np.array([100000, 1, 2, 3, 70000, 4], dtype="<i4")
    (tmp_path / "theirs.bin").write_bytes(tokens.tobytes())
    (tmp_path / "theirs.idx").write_bytes(megatron_idx([2, 2, 2], [0, 2, 3], 4, 4))
    reader = ShardReader(tmp_path / "theirs")
    assert reader.dtype == np.int32 and len(reader) == 2 and reader.num_tokens == 6
    assert reader[0].tolist() == [100000, 1, 2, 3] and reader[1].tolist() == [70000, 4]
    assert reader[-1].tolist() == [70000, 4]
    with pytest.raises(IndexError):
        reader[2]


def test_round_trip_many_documents(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, size=rng.integers(1, 300)) for _ in range(500)]
    write_shard(tmp_path / "s", docs, np.uint16)
    reader = ShardReader(tmp_path / "s")
    assert len(reader) == 500 and reader.num_tokens == sum(map(len, docs))
    for i in (0, 17, 499):
        assert np.array_equal(reader[i], docs[i])


def test_token_dtype_rule():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.int32
    with pytest.raises(GoodputError, match="does not fit"):
        token_dtype(2**31 + 5)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda p: p.with_suffix(".idx").write_bytes(p.with_suffix(".idx").read_bytes()[:40]),
            "truncated",
        ),
        (
            lambda p: p.with_suffix(".idx").write_bytes(
                b"NOTMAGIC!" + p.with_suffix(".idx").read_bytes()[9:]
            ),
            "bad magic",
        ),
        (
            lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes()[:-2]),
            "truncated",
        ),
        (
            lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes() + b"xx"),
            "trailing data",
        ),
        (lambda p: p.with_suffix(".idx").write_bytes(b"short"), "shorter than"),
        (lambda p: p.with_suffix(".bin").unlink(), "missing"),
    ],
)
def test_corrupt_files_are_named_errors(tmp_path, damage, message):
    write_shard(tmp_path / "s", [np.array([1, 2, 0]), np.array([3, 0])], np.uint16)
    damage(tmp_path / "s.bin")
    with pytest.raises(GoodputError, match=message) as exc:
        ShardReader(tmp_path / "s")
    assert "s.bin" in exc.value.render() or "s.idx" in exc.value.render()


def test_aborted_writer_leaves_nothing(tmp_path):
    writer = ShardWriter(tmp_path / "s", np.dtype(np.uint16))
    writer.add_documents(np.array([1, 0], np.uint16), np.array([2]))
    writer.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ((b"MMIDIDX\x00\x00", 1, 8, 2**60, 2**60 + 1), "the header promises at least"),
        ((b"MMIDIDX\x00\x00", 1, 8, 2**64 - 1, 2**64 - 1), "the header promises at least"),
        ((b"MMIDIDX\x00\x00", 2, 8, 2, 3), "index version 2"),
        ((b"MMIDIDX\x00\x00", 1, 9, 2, 3), "unknown dtype code 9"),
        ((b"MMIDIDX\x00\x00", 1, 6, 2, 3), "dtype code 6 (float64) is not an integer token type"),
        ((b"MMIDIDX\x00\x00", 1, 8, 2, 0), "document boundaries do not cover"),
    ],
)
def test_absurd_headers_are_named_errors_without_allocating(tmp_path, header, message):
    write_shard(tmp_path / "s", [np.array([1, 2, 0]), np.array([3, 0])], np.uint16)
    idx = (tmp_path / "s.idx").read_bytes()
    (tmp_path / "s.idx").write_bytes(struct.pack("<9sQBQQ", *header) + idx[34:])
    with pytest.raises(GoodputError, match=re.escape(message)) as exc:
        ShardReader(tmp_path / "s")
    assert exc.value.render().startswith(f"{tmp_path / 's.idx'}: corrupt shard: ")


def test_boundaries_out_of_order_are_refused(tmp_path):
    (tmp_path / "s.bin").write_bytes(np.arange(6, dtype="<u2").tobytes())
    (tmp_path / "s.idx").write_bytes(megatron_idx([2, 2, 2], [0, 3, 1, 3], 8, 2))
    with pytest.raises(GoodputError, match="in order"):
        ShardReader(tmp_path / "s")


def test_a_folder_where_a_shard_file_should_be_is_a_named_error(tmp_path):
    write_shard(tmp_path / "s", [np.array([1, 0])], np.uint16)
    (tmp_path / "s.bin").unlink()
    (tmp_path / "s.bin").mkdir()
    with pytest.raises(GoodputError, match="s.bin: is not a regular file"):
        ShardReader(tmp_path / "s")
