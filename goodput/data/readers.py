"""Reading raw corpora: which files are inputs, and the documents inside each one.

Owns ``list_inputs`` (named files and folders -> a deterministic list of input files) and
``iter_texts`` (one input file -> its documents' text, one at a time). Formats, by suffix:
``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` (one JSON object per line, text under ``text_field``),
``.parquet`` (text in the ``text_field`` column) and ``.txt`` (the whole file is one document).

Invariants: the same inputs always give the same files in the same order and the same documents;
every problem a user can fix is a ``GoodputError`` naming the file, and ``file:line`` (or
``file:row N`` for Parquet) where there is one. Empty or whitespace-only documents are skipped and
counted in ``ReadStats``; blank JSONL lines are skipped silently and are not documents.

Speed: tokenization must run at the tokenizer's own rate, so the per-line path is one UTF-8 decode,
one ``json.loads`` and a type check. Files are read in large chunks and split into lines in C;
everything that diagnoses a bad line runs only after the fast path has failed.

It does not tokenize, deduplicate or filter documents, and keeps no state between files.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import zstandard

from goodput.data.paths import file_identity
from goodput.errors import GoodputError
from goodput.io import (
    json_type_name,
    nested_too_deeply,
    open_regular,
    path_status,
    regular_files,
    require_regular,
)

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".txt")

# Plain files are read 8 MiB at a time. Compressed ones 1 MiB at a time: text inflates 3-10x, and
# a smaller input chunk bounds the memory one decompress call can ask for.
READ_BYTES = 8 << 20
COMPRESSED_READ_BYTES = 1 << 20
# Rows per Parquet batch: documents can be megabytes each, so batches stay modest.
PARQUET_BATCH_ROWS = 1024
# Keys quoted when a JSONL object lacks the text field; records can have hundreds.
MAX_KEYS_SHOWN = 12


@dataclass(slots=True)
class ReadStats:
    """Counters ``iter_texts`` updates as it goes, for progress lines and the final report.

    ``num_bytes`` counts raw (still compressed) bytes read from disk, in whole read chunks, so it
    runs slightly ahead of the documents yielded and equals the file size once a file is done
    (for Parquet it advances in proportion to the rows read).
    """

    num_empty_skipped: int = 0
    num_bytes: int = 0


def input_suffix(path: Path) -> str | None:
    """The input format of ``path`` (one of ``SUFFIXES``), or None if it is not an input."""
    return next((suffix for suffix in SUFFIXES if path.name.endswith(suffix)), None)


def list_inputs(paths: Sequence[str | Path]) -> list[Path]:
    """Expand ``paths`` into input files: named files as given, folders recursively and sorted.

    Inside folders, hidden entries, files of other types and what is no regular file (a FIFO,
    with a note) are skipped; a folder that yields no inputs and any missing, unreadable, empty,
    unknown or not regular file are errors. A file reached twice
    (named twice, inside a named folder too, or through a symbolic or hard link) is read once,
    where it first appears, and said so on stderr.
    """
    inputs: list[Path] = []
    for given in paths:
        path = Path(given)
        is_dir = _check_readable(path)
        inputs.extend(_folder_inputs(path) if is_dir else [_named_input(path)])
    seen: dict[tuple[int, int], Path] = {}
    for path in inputs:
        first = seen.setdefault(file_identity(path), path)
        if first is not path:
            print(f"{path}: the same file as {first}; reading it once", file=sys.stderr)
    return list(seen.values())


def _check_readable(path: Path) -> bool:
    """Whether ``path`` is a folder, once it is something this user may read."""
    status = path_status(path)  # a loop of links is named as one, not as missing
    if status is None:
        raise GoodputError(path, "no such file or folder", "check the path")
    is_dir = stat.S_ISDIR(status.st_mode)
    needed = os.R_OK | os.X_OK if is_dir else os.R_OK
    if not os.access(path, needed):
        raise GoodputError(path, "permission denied", "make it readable or leave it out")
    return is_dir


def _named_input(path: Path) -> Path:
    if input_suffix(path) is None:
        raise GoodputError(
            path,
            "is not a known input format",
            f"use one of {', '.join(SUFFIXES)} (or convert the file)",
        )
    return _non_empty(require_regular(path))


def _non_empty(path: Path) -> Path:
    if path.stat().st_size == 0:
        raise GoodputError(path, "is empty", "remove it from the inputs or regenerate it")
    return path


def _folder_inputs(folder: Path) -> list[Path]:
    found = []
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        hidden = any(part.startswith(".") for part in relative.parts)
        if not hidden and input_suffix(path) is not None and not path.is_dir():
            found.append((relative.as_posix(), path))
    # A FIFO, socket or device named like an input is skipped with a note, never read.
    regular = set(regular_files([path for _, path in found]))
    found = [(relative, path) for relative, path in found if path in regular]
    if not found:
        raise GoodputError(
            folder,
            f"holds no input files ({', '.join(SUFFIXES)})",
            "point at the folder that holds the corpus files",
        )
    return [_non_empty(path) for _, path in sorted(found)]


def iter_texts(
    path: Path, text_field: str = "text", stats: ReadStats | None = None
) -> Iterator[str]:
    """Yield the text of each non-empty document in ``path``, in file order.

    ``stats``, when given, is updated in place: empty documents skipped, raw bytes read.
    """
    path = Path(path)
    stats = stats if stats is not None else ReadStats()
    suffix = input_suffix(path)
    if suffix == ".parquet":
        return _parquet_texts(path, text_field, stats)
    if suffix == ".txt":
        return _txt_texts(path, stats)
    if suffix == ".jsonl":
        chunks = _raw_chunks(path, READ_BYTES, stats)
    elif suffix == ".jsonl.gz":
        # wbits=31: gzip header and trailer, as `gzip` writes them.
        chunks = _decompressed(path, "gzip", lambda: zlib.decompressobj(wbits=31), stats)
    elif suffix == ".jsonl.zst":
        chunks = _decompressed(path, "zstd", zstandard.ZstdDecompressor().decompressobj, stats)
    else:
        raise GoodputError(path, "is not a known input format", f"use one of {', '.join(SUFFIXES)}")
    return _jsonl_texts(path, chunks, text_field, stats)


def _raw_chunks(path: Path, chunk_bytes: int, stats: ReadStats) -> Iterator[bytes]:
    with open_regular(path) as file:  # a FIFO is refused, never waited on
        while chunk := file.read(chunk_bytes):
            stats.num_bytes += len(chunk)
            yield chunk


class _Decompressor(Protocol):
    """What ``zlib`` and ``zstandard`` decompression objects have in common."""

    @property
    def eof(self) -> bool: ...
    @property
    def unused_data(self) -> bytes: ...
    def decompress(self, data: bytes) -> bytes: ...


def _decompressed(
    path: Path, format_name: str, new_decompressor: Callable[[], _Decompressor], stats: ReadStats
) -> Iterator[bytes]:
    """Decompressed chunks of a gzip or zstd file, of any number of members or frames.

    Concatenated members (``cat a.gz b.gz``, multi-frame zstd) are valid streams: when one ends,
    its leftover input starts the next. A stream that stops inside a member is truncated; the
    ``zstandard`` stream reader would silently return the partial data, hence this loop.
    """
    decompressor = new_decompressor()
    num_bytes_in_member = 0
    try:
        for chunk in _raw_chunks(path, COMPRESSED_READ_BYTES, stats):
            while chunk:
                num_bytes_in_member += len(chunk)
                if output := decompressor.decompress(chunk):
                    yield output
                if not decompressor.eof:
                    break
                chunk = decompressor.unused_data
                decompressor = new_decompressor()
                num_bytes_in_member = 0
    except (zlib.error, zstandard.ZstdError) as error:
        raise GoodputError(
            path, f"corrupt {format_name} stream: {error}", "re-create or re-download the file"
        ) from None
    if num_bytes_in_member and not decompressor.eof:
        raise GoodputError(
            path,
            f"{format_name} stream ends early (truncated file?)",
            "re-create or re-download the file",
        )


def _lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Split chunks at b"\\n" without the newline; the last line may lack one."""
    pending = b""
    for chunk in chunks:
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        yield from lines
    if pending:
        yield pending


def _jsonl_texts(
    path: Path, chunks: Iterable[bytes], text_field: str, stats: ReadStats
) -> Iterator[str]:
    loads = json.loads
    for line_number, line in enumerate(_lines(chunks), start=1):
        try:
            text = loads(line.decode("utf-8"))[text_field]
        # ValueError covers bad UTF-8 and bad JSON; RecursionError, arrays nested thousands deep.
        except (ValueError, KeyError, TypeError, RecursionError):
            if not line or line.isspace():
                continue
            raise _line_error(f"{path}:{line_number}", line, text_field) from None
        if type(text) is not str:
            raise _field_type_error(f"{path}:{line_number}", text, text_field)
        if not text or text.isspace():
            stats.num_empty_skipped += 1
            continue
        yield text


def _line_error(where: str, line: bytes, text_field: str) -> GoodputError:
    """Say precisely why ``line`` failed the fast path."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        return GoodputError(
            where, f"invalid UTF-8 at byte {error.start} of the line", "re-encode the file as UTF-8"
        )
    except json.JSONDecodeError as error:
        # Some of json's messages end in " at" ("Unterminated string starting at").
        reason = f"{error.msg.removesuffix(' at')} at column {error.colno}"
        return GoodputError(where, f"malformed JSON: {reason}", "fix or remove the line")
    except RecursionError:
        return nested_too_deeply(where, "fix or remove the line")
    if not isinstance(record, dict):
        return GoodputError(
            where,
            f"expected a JSON object, got {json_type_name(record)}",
            f'write one object per line, e.g. {{"{text_field}": "..."}}',
        )
    keys = ", ".join(repr(key) for key in list(record)[:MAX_KEYS_SHOWN])
    more = f" and {len(record) - MAX_KEYS_SHOWN} more" if len(record) > MAX_KEYS_SHOWN else ""
    return GoodputError(
        where,
        f"no {text_field!r} field; keys present: {keys or 'none'}{more}",
        "name the field that holds the document text with --text-field",
    )


def _field_type_error(where: str, value: Any, text_field: str) -> GoodputError:
    return GoodputError(
        where,
        f"field {text_field!r} is {json_type_name(value)}, not a string",
        "store the document text as a string, or name another field with --text-field",
    )


def _txt_texts(path: Path, stats: ReadStats) -> Iterator[str]:
    data = b"".join(_raw_chunks(path, READ_BYTES, stats))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line_number = data.count(b"\n", 0, error.start) + 1
        raise GoodputError(
            f"{path}:{line_number}", "invalid UTF-8", "re-encode the file as UTF-8"
        ) from None
    if not text or text.isspace():
        stats.num_empty_skipped += 1
        return
    yield text


def _parquet_texts(path: Path, text_field: str, stats: ReadStats) -> Iterator[str]:
    # Imported here: pyarrow takes a noticeable fraction of a second to import, and most runs
    # read JSONL only.
    import pyarrow as pa
    import pyarrow.parquet as pq

    require_regular(path)  # pyarrow opens it itself, and would wait on a FIFO
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise GoodputError(
            path, f"not a readable Parquet file ({error})", "re-create or re-download the file"
        ) from None
    _check_text_column(path, parquet.schema_arrow, text_field)
    num_rows = parquet.metadata.num_rows
    file_bytes = path.stat().st_size
    row_number = 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                row_number += 1
                if text is None:
                    raise _field_type_error(f"{path}:row {row_number}", text, text_field)
                if not text or text.isspace():
                    stats.num_empty_skipped += 1
                    continue
                yield text
            # Parquet has no cheap byte position; rows read stand in for it.
            stats.num_bytes += file_bytes * batch.num_rows // num_rows
    except (pa.ArrowException, OSError) as error:
        raise GoodputError(
            f"{path}:row {row_number + 1}",
            f"unreadable Parquet data ({error})",
            "re-create or re-download the file",
        ) from None


def _check_text_column(path: Path, schema: Any, text_field: str) -> None:
    import pyarrow as pa

    if text_field not in schema.names:
        columns = ", ".join(repr(name) for name in schema.names[:MAX_KEYS_SHOWN])
        raise GoodputError(
            path,
            f"no {text_field!r} column; columns present: {columns or 'none'}",
            "name the column that holds the document text with --text-field",
        )
    column_type = schema.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise GoodputError(
            path,
            f"column {text_field!r} has type {column_type}, not string",
            "store the document text as strings, or name another column with --text-field",
        )
