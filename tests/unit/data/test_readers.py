"""Readers: every format yields the same documents; every bad input is a one-line GoodputError."""

import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from goodput.data import readers
from goodput.data.readers import ReadStats, iter_texts, list_inputs
from goodput.errors import GoodputError

TEXTS = [
    "plain ascii document",
    "two\nlines with a trailing newline\n",
    "unicode: héllo wörld, 世界, emoji 🙂, U+2028 [\u2028]",
    'quotes " and backslashes \\ and tabs \t',
    "x" * 5000,
]


def jsonl_bytes(records):
    return "".join(json.dumps(record) + "\n" for record in records).encode()


def write_input(path, texts):
    """Write ``texts`` as documents of the format ``path``'s suffix names."""
    data = jsonl_bytes({"text": text, "id": i} for i, text in enumerate(texts))
    if path.name.endswith(".jsonl"):
        path.write_bytes(data)
    elif path.name.endswith(".jsonl.gz"):
        path.write_bytes(gzip.compress(data))
    elif path.name.endswith(".jsonl.zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    elif path.name.endswith(".parquet"):
        pq.write_table(pa.table({"id": range(len(texts)), "text": texts}), path, row_group_size=2)
    return path


def read(path, **kwargs):
    stats = ReadStats()
    return list(iter_texts(path, stats=stats, **kwargs)), stats


def error_of(function, *args):
    """The one-line message of the GoodputError that ``function(*args)`` raises, read fully."""
    with pytest.raises(GoodputError) as info:
        list(function(*args))
    message = str(info.value)
    assert "\n" not in message
    return message


FORMATS = ["a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.parquet"]


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_round_trips(tmp_path, name):
    path = write_input(tmp_path / name, TEXTS)
    texts, stats = read(path)
    assert texts == TEXTS
    assert stats.num_empty_skipped == 0
    assert stats.num_bytes == path.stat().st_size


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.jsonl.zst"])
def test_lines_and_streams_split_across_read_chunks(tmp_path, name, monkeypatch):
    monkeypatch.setattr(readers, "READ_BYTES", 7)
    monkeypatch.setattr(readers, "COMPRESSED_READ_BYTES", 5)
    path = write_input(tmp_path / name, TEXTS)
    assert read(path)[0] == TEXTS


def test_txt_is_one_document(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(TEXTS[2] + "\nsecond line\n", encoding="utf-8")
    assert read(path)[0] == [TEXTS[2] + "\nsecond line\n"]


def test_concatenated_gzip_members_and_zstd_frames(tmp_path):
    first, second = jsonl_bytes([{"text": "one"}]), jsonl_bytes([{"text": "two"}])
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(first) + gzip.compress(second))
    zst = tmp_path / "a.jsonl.zst"
    compressor = zstandard.ZstdCompressor()
    zst.write_bytes(compressor.compress(first) + compressor.compress(second))
    assert read(gz)[0] == read(zst)[0] == ["one", "two"]


def test_empty_documents_are_skipped_and_counted(tmp_path):
    texts = ["a", "", "  \n\t", "b"]
    for name in FORMATS:
        result, stats = read(write_input(tmp_path / name, texts))
        assert (result, stats.num_empty_skipped) == (["a", "b"], 2), name
    blank_txt = tmp_path / "blank.txt"
    blank_txt.write_text(" \n\n")
    assert read(blank_txt)[0] == []
    assert read(blank_txt)[1].num_empty_skipped == 1


def test_blank_lines_are_not_documents(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'\n{"text": "a"}\n   \n\r\n{"text": "b"}')  # no final newline either
    texts, stats = read(path)
    assert texts == ["a", "b"]
    assert stats.num_empty_skipped == 0


def test_other_text_field(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(jsonl_bytes([{"content": "x", "text": 1}]))
    assert read(path, text_field="content")[0] == ["x"]


# --- bad JSONL lines: file:line, what, fix ---------------------------------------------------


def write_lines(tmp_path, *lines):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_malformed_json_names_file_and_line(tmp_path):
    path = write_lines(tmp_path, b'{"text": "ok"}', b"", b'{"text": "unterminated}')
    message = error_of(iter_texts, path)
    assert f"{path}:3: malformed JSON" in message
    assert "fix or remove the line" in message


@pytest.mark.parametrize("nested", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1"])
def test_json_nested_too_deeply_names_file_and_line(tmp_path, nested):
    path = write_lines(tmp_path, b'{"text": "ok"}', nested)
    message = error_of(iter_texts, path)
    assert f"{path}:2: is JSON nested too deeply; fix or remove the line" in message


def test_missing_field_lists_keys_and_suggests_text_field(tmp_path):
    path = write_lines(tmp_path, b'{"text": "ok"}', b'{"content": "x", "id": 7}')
    message = error_of(iter_texts, path)
    assert f"{path}:2" in message
    assert "'content', 'id'" in message
    assert "--text-field" in message


@pytest.mark.parametrize(
    ("line", "expected"),
    [(b'{"text": 5}', "is a number, not a string"), (b'{"text": null}', "is null, not a string")],
)
def test_non_string_field(tmp_path, line, expected):
    path = write_lines(tmp_path, line)
    message = error_of(iter_texts, path)
    assert f"{path}:1" in message and expected in message


@pytest.mark.parametrize("line", [b'["text"]', b'"text"', b"42"])
def test_non_object_line(tmp_path, line):
    path = write_lines(tmp_path, b'{"text": "ok"}', line)
    message = error_of(iter_texts, path)
    assert f"{path}:2: expected a JSON object" in message


def test_invalid_utf8_names_the_line(tmp_path):
    path = write_lines(tmp_path, b'{"text": "ok"}', b'{"text": "caf\xe9"}')
    message = error_of(iter_texts, path)
    assert f"{path}:2: invalid UTF-8" in message


def test_invalid_utf8_in_txt_names_the_line(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"fine\nstill fine\nbad \xff here\n")
    assert f"{path}:3: invalid UTF-8" in error_of(iter_texts, path)


# --- bad compressed and Parquet files --------------------------------------------------------


@pytest.mark.parametrize("name", ["a.jsonl.gz", "a.jsonl.zst"])
def test_truncated_stream(tmp_path, name):
    path = write_input(tmp_path / name, TEXTS * 50)
    path.write_bytes(path.read_bytes()[:-20])
    message = error_of(iter_texts, path)
    assert str(path) in message and "truncated" in message


@pytest.mark.parametrize("name", ["a.jsonl.gz", "a.jsonl.zst"])
def test_corrupt_stream(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"this is not compressed at all")
    message = error_of(iter_texts, path)
    assert str(path) in message and "corrupt" in message


def test_parquet_without_the_column(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"content": ["x"], "id": [1]}), path)
    message = error_of(iter_texts, path)
    assert str(path) in message and "'content', 'id'" in message and "--text-field" in message


def test_parquet_column_of_the_wrong_type(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), path)
    assert "not string" in error_of(iter_texts, path)


def test_parquet_null_names_the_row(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["a", None]}), path)
    assert f"{path}:row 2" in error_of(iter_texts, path)


def test_corrupt_parquet(tmp_path):
    path = write_input(tmp_path / "a.parquet", TEXTS)
    path.write_bytes(path.read_bytes()[:-100])
    assert f"{path}: not a readable Parquet file" in error_of(iter_texts, path)


# --- list_inputs -----------------------------------------------------------------------------


def touch(path, data=b'{"text": "x"}\n'):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_folders_expand_sorted_and_skip_hidden_and_unknown(tmp_path):
    corpus = tmp_path / "corpus"
    wanted = [
        touch(corpus / "a.jsonl"),
        touch(corpus / "b" / "c.jsonl.zst"),
        touch(corpus / "b.parquet"),
        touch(corpus / "z.txt"),
    ]
    touch(corpus / ".hidden.jsonl")
    touch(corpus / ".cache" / "x.jsonl")
    touch(corpus / "README.md")
    single = touch(tmp_path / "single.jsonl.gz")
    assert list_inputs([single, str(corpus)]) == [single, *sorted(wanted, key=lambda p: str(p))]
    assert list_inputs([corpus]) == list_inputs([corpus])


def test_missing_path(tmp_path):
    assert f"{tmp_path / 'nope'}: no such file" in error_of(list_inputs, [tmp_path / "nope"])


def test_named_file_of_unknown_format(tmp_path):
    path = touch(tmp_path / "a.csv")
    message = error_of(list_inputs, [path])
    assert f"{path}: is not a known input format" in message and ".jsonl.zst" in message


def test_empty_file(tmp_path):
    path = touch(tmp_path / "corpus" / "a.jsonl", b"")
    assert f"{path}: is empty" in error_of(list_inputs, [path])
    assert f"{path}: is empty" in error_of(list_inputs, [tmp_path / "corpus"])


def test_folder_without_inputs(tmp_path):
    touch(tmp_path / "notes.md")
    touch(tmp_path / ".hidden.jsonl")
    assert f"{tmp_path}: holds no input files" in error_of(list_inputs, [tmp_path])


def test_a_file_reached_twice_is_read_once(tmp_path, capsys):
    folder = tmp_path / "corpus"
    path = touch(folder / "a.jsonl")
    os.link(path, folder / "b.jsonl")
    (tmp_path / "c.jsonl").symlink_to(path)
    assert list_inputs([folder, path, tmp_path / "c.jsonl"]) == [path]
    err = capsys.readouterr().err
    assert f"{folder / 'b.jsonl'}: the same file as {path}; reading it once" in err
    assert f"{tmp_path / 'c.jsonl'}: the same file as {path}; reading it once" in err


def test_unreadable_file(tmp_path, monkeypatch):
    path = touch(tmp_path / "a.jsonl")
    # Tests often run as root, which reads files whatever their mode: fake the refusal instead.
    monkeypatch.setattr(os, "access", lambda *_: False)
    assert f"{path}: permission denied" in error_of(list_inputs, [path])
