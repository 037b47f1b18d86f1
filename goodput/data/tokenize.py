"""Tokenize once: raw documents -> few large Megatron ``.bin/.idx`` shards + a manifest.

The job is split into *units*: consecutive input files (sorted) grouped until they reach the
shard size; unit ``u`` writes exactly one shard ``<name>_<u:05d>``. Units are a pure function
of the inputs and ``--shard-size-mb``, so the output is the same for any number of workers or
ranks: ranks (``RANK``/``WORLD_SIZE``) take units ``u ≡ rank (mod world)``, and within a rank
``--workers`` processes take whole units, each reading its inputs in large chunks, encoding in
batches and writing its own shard (no per-document traffic to a central writer).

Completion is layered: a shard's ``.bin`` and ``.idx`` appear only when whole (temp + rename),
then its part record ``.parts/<shard>.json`` (checksums, sizes, counts) is written; a unit counts
as done only when its record exists and the files on disk have the recorded sizes, so a rerun
after a kill redoes exactly the unfinished units. ``<name>.manifest.json`` is written last, by
whichever rank finishes the final unit: it is the dataset's completion marker.

Every file the job writes is named after ``--name``, checked to be a plain name (``paths``) before
anything is written, so all of them land inside ``--output``. Inputs reached twice (another
path, a link) are read once (``readers.list_inputs``).
"""

from __future__ import annotations

import concurrent.futures as futures
import itertools
import multiprocessing as mp
import queue
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from goodput import __version__
from goodput.data import readers
from goodput.data.manifest import manifest_path, read_dataset_manifest, read_part_record
from goodput.data.paths import check_name
from goodput.data.schema import SHARDS_FORMAT
from goodput.data.shards import ShardWriter, bin_path, idx_path, token_dtype
from goodput.data.tokenizer import load_tokenizer
from goodput.errors import GoodputError
from goodput.io import sha256_file, sha256_json, stray_temps, write_json
from goodput.outputs import DATA_DIR, check_output_dir
from goodput.progress import BYTES, Progress

BATCH_CHARS = 4 << 20  # characters of text per encode call: big enough to amortise overhead
PARTS_DIR = ".parts"


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizeJob:
    inputs: list[Path]
    tokenizer: Path
    tokenizer_kind: str | None
    output: Path
    name: str
    num_workers: int
    shard_size_mb: float
    text_field: str
    pack_seq_len: int | None
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        checks = (
            (self.num_workers >= 1, "--workers", "must be at least 1"),
            (self.shard_size_mb > 0, "--shard-size-mb", "must be positive"),
            (
                self.pack_seq_len is None or self.pack_seq_len >= 1,
                "--pack-seq-len",
                "must be at least 1",
            ),
            (
                0 <= self.rank < self.world_size,
                "RANK/WORLD_SIZE",
                f"rank {self.rank} is outside a world of {self.world_size}",
            ),
        )
        for ok, where, what in checks:
            if not ok:
                raise GoodputError.usage(where, what, "fix the value")
        check_name(self.name, "--name")
        check_output_dir(self.output, DATA_DIR, "--output")


def plan_units(inputs: list[Path], shard_bytes: int) -> list[list[Path]]:
    """Group sorted inputs into units of about ``shard_bytes`` of input each (whole files)."""
    units: list[list[Path]] = []
    size = 0
    for path in inputs:
        if not units or size >= shard_bytes:
            units.append([])
            size = 0
        units[-1].append(path)
        size += path.stat().st_size
    return units


def shard_name(name: str, unit: int) -> str:
    return f"{name}_{unit:05d}"


def run(job: TokenizeJob) -> dict[str, Any] | None:
    """Tokenize this rank's pending units; return the manifest if this rank completed the set."""
    inputs = readers.list_inputs(job.inputs)
    tokenizer = load_tokenizer(job.tokenizer, job.tokenizer_kind)
    dtype = token_dtype(tokenizer.vocab_size)
    units = plan_units(inputs, int(job.shard_size_mb * (1 << 20)))
    job_key = sha256_json(
        {
            "format": SHARDS_FORMAT,
            "tokenizer": tokenizer.identity()["sha256"],
            "library": tokenizer.identity()["library"],
            "name": job.name,
            "inputs": [[str(p.resolve()), p.stat().st_size] for p in inputs],
            "shard_size_mb": job.shard_size_mb,
            "text_field": job.text_field,
            "pack_seq_len": job.pack_seq_len,
        }
    )
    _refuse_foreign_output(job, job_key)
    manifest_file = manifest_path(job.output, job.name)
    if manifest_file.exists():  # _refuse_foreign_output checked it is this job's
        print(f"{manifest_file}: already complete, nothing to do", file=sys.stderr)
        return read_dataset_manifest(manifest_file)
    mine = [u for u in range(len(units)) if u % job.world_size == job.rank]
    pending = [u for u in mine if not _unit_done(job, u, job_key)]
    if len(pending) < len(mine):
        print(
            f"tokenize: resuming, {len(mine) - len(pending)} of {len(mine)} shards already done",
            file=sys.stderr,
        )
    if pending:
        _run_units(job, units, pending, job_key, dtype)
    if all(_unit_done(job, u, job_key) for u in range(len(units))):
        return _write_manifest(job, units, job_key, tokenizer.identity(), dtype)
    print(
        f"tokenize: rank {job.rank} done; the rank finishing last writes the manifest",
        file=sys.stderr,
    )
    return None


def _refuse_foreign_output(job: TokenizeJob, job_key: str) -> None:
    """Never mix two different jobs' shards under one name: earlier outputs stay untouched."""
    records = [manifest_path(job.output, job.name)]
    parts = job.output / PARTS_DIR
    if parts.is_dir():
        records += sorted(parts.glob(f"{job.name}_[0-9][0-9][0-9][0-9][0-9].json"))
    for record in records:
        if record.exists() and _read_record(record)["job_key"] != job_key:
            raise GoodputError(
                record,
                f"dataset '{job.name}' here was built from other inputs or settings",
                "choose another --output or --name, or delete the old dataset first",
            )


def _read_record(path: Path) -> dict[str, Any]:
    is_manifest = path.name.endswith(".manifest.json")
    return read_dataset_manifest(path) if is_manifest else read_part_record(path)


def _part_path(job: TokenizeJob, unit: int) -> Path:
    return job.output / PARTS_DIR / f"{shard_name(job.name, unit)}.json"


def _unit_done(job: TokenizeJob, unit: int, job_key: str) -> bool:
    part = _part_path(job, unit)
    if not part.exists():
        return False
    record = read_part_record(part)
    prefix = job.output / shard_name(job.name, unit)
    try:
        sizes = (bin_path(prefix).stat().st_size, idx_path(prefix).stat().st_size)
    except FileNotFoundError:
        return False
    return (record["job_key"], record["shard"], *sizes) == (
        job_key,
        prefix.name,
        record["bin_bytes"],
        record["idx_bytes"],
    )


def _run_units(
    job: TokenizeJob, units: list[list[Path]], pending: list[int], job_key: str, dtype: np.dtype
) -> None:
    ctx = mp.get_context("spawn")
    progress_queue = ctx.Queue()
    total_bytes = sum(p.stat().st_size for u in pending for p in units[u])
    num_workers = max(1, min(job.num_workers, len(pending)))
    with (
        Progress("tokenize", total=total_bytes, unit=BYTES) as progress,
        futures.ProcessPoolExecutor(
            num_workers, mp_context=ctx, initializer=_worker_init, initargs=(job, progress_queue)
        ) as pool,
    ):
        tasks = {pool.submit(_tokenize_unit, u, units[u], job_key, dtype.str): u for u in pending}
        not_done = set(tasks)
        try:
            while not_done:
                _drain(progress_queue, progress)
                done, not_done = futures.wait(
                    not_done, timeout=0.2, return_when=futures.FIRST_COMPLETED
                )
                for task in done:
                    task.result()  # re-raises a worker's GoodputError here
        except BaseException:
            for task in not_done:
                task.cancel()
            raise
        _drain(progress_queue, progress)


def _drain(progress_queue: Any, progress: Progress) -> None:
    while True:
        try:
            docs, tokens, nbytes = progress_queue.get_nowait()
        except queue.Empty:
            return
        progress.advance(nbytes, docs=docs, tokens=tokens)


_WORKER: dict[str, Any] = {}


def _worker_init(job: TokenizeJob, progress_queue: Any) -> None:
    _WORKER["job"] = job
    _WORKER["tokenizer"] = load_tokenizer(job.tokenizer, job.tokenizer_kind)
    _WORKER["progress"] = progress_queue


def _tokenize_unit(unit: int, inputs: list[Path], job_key: str, dtype_str: str) -> None:
    """Worker body: tokenize one unit's inputs into one shard, then write its part record."""
    job: TokenizeJob = _WORKER["job"]
    prefix = job.output / shard_name(job.name, unit)
    # A killed earlier attempt at this unit may have left temp files; the unit is ours alone.
    for final in (bin_path(prefix), idx_path(prefix), _part_path(job, unit)):
        for stale in stray_temps(final):
            stale.unlink(missing_ok=True)
    encoder = _Encoder(_WORKER["tokenizer"], np.dtype(dtype_str), job.pack_seq_len)
    writer = ShardWriter(prefix, encoder.dtype)
    stats = readers.ReadStats()
    try:
        for path in inputs:
            batch: list[str] = []
            batch_chars = 0
            bytes_before = stats.num_bytes
            for text in readers.iter_texts(path, job.text_field, stats):
                batch.append(text)
                batch_chars += len(text)
                if batch_chars >= BATCH_CHARS:
                    _write_batch(writer, encoder, batch, path, stats.num_bytes - bytes_before)
                    bytes_before = stats.num_bytes
                    batch, batch_chars = [], 0
            _write_batch(writer, encoder, batch, path, stats.num_bytes - bytes_before)
        bin_sha256 = writer.finish()
    except BaseException:
        writer.abort()
        raise
    write_json(
        _part_path(job, unit),
        {
            "job_key": job_key,
            "shard": prefix.name,
            "sha256_bin": bin_sha256,
            "sha256_idx": sha256_file(idx_path(prefix)),
            "bin_bytes": bin_path(prefix).stat().st_size,
            "idx_bytes": idx_path(prefix).stat().st_size,
            "num_documents": writer.num_documents,
            "num_tokens": writer.num_tokens,
            "num_empty_skipped": stats.num_empty_skipped,
            "num_tokens_dropped": encoder.num_tokens_dropped(),
            "inputs": [{"path": str(p), "bytes": p.stat().st_size} for p in inputs],
        },
    )


def _write_batch(
    writer: ShardWriter, encoder: _Encoder, batch: list[str], path: Path, nbytes: int
) -> None:
    tokens, lengths = encoder.encode(batch, path)
    if len(lengths):
        writer.add_documents(tokens, lengths)
    _WORKER["progress"].put((len(batch), len(tokens), nbytes))


class _Encoder:
    """Texts -> one flat token array with EOD after each document (and its length counted).

    With ``pack_seq_len`` L the stream is cut into rows of L+1 tokens across document
    boundaries; the tail that does not fill a row is carried to the next batch and dropped
    (counted) at the end of the shard.
    """

    def __init__(self, tokenizer: Any, dtype: np.dtype, pack_seq_len: int | None):
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.row = pack_seq_len + 1 if pack_seq_len else 0
        self.carry = np.zeros(0, dtype)

    def encode(self, texts: list[str], path: Path) -> tuple[np.ndarray, np.ndarray]:
        ids = self.tokenizer.encode_batch(texts)
        eod = self.tokenizer.eod_id
        for doc in ids:
            doc.append(eod)
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        try:  # straight into the shard dtype: numpy refuses ids that do not fit it
            tokens = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, int(lengths.sum()))
        except OverflowError as error:
            raise GoodputError(
                path,
                f"a token id does not fit {self.dtype} ({error})",
                "the tokenizer's vocab_size is wrong; check the tokenizer file",
            ) from None
        if not self.row:
            return tokens, lengths
        stream = np.concatenate([self.carry, tokens])
        num_rows = len(stream) // self.row
        self.carry = stream[num_rows * self.row :]
        return stream[: num_rows * self.row], np.full(num_rows, self.row, np.int64)

    def num_tokens_dropped(self) -> int:
        return len(self.carry)


def _write_manifest(
    job: TokenizeJob,
    units: list[list[Path]],
    job_key: str,
    tokenizer_identity: dict[str, Any],
    dtype: np.dtype,
) -> dict[str, Any]:
    parts = [read_part_record(_part_path(job, u)) for u in range(len(units))]
    shards = [
        {
            key: part[key]
            for key in (
                "shard",
                "sha256_bin",
                "sha256_idx",
                "bin_bytes",
                "idx_bytes",
                "num_documents",
                "num_tokens",
                "inputs",
            )
        }
        for part in parts
    ]
    manifest = {
        "format": SHARDS_FORMAT,
        "name": job.name,
        "job_key": job_key,
        "goodput_version": __version__,
        "tokenizer": tokenizer_identity,
        "dtype": dtype.name,
        "text_field": job.text_field,
        "pack_seq_len": job.pack_seq_len,
        "num_documents": sum(p["num_documents"] for p in parts),
        "num_tokens": sum(p["num_tokens"] for p in parts),
        "num_empty_skipped": sum(p["num_empty_skipped"] for p in parts),
        "num_tokens_dropped": sum(p["num_tokens_dropped"] for p in parts),
        "shards": shards,
    }
    write_json(manifest_path(job.output, job.name), manifest)
    return manifest
