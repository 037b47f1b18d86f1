"""Saving: the step pays for a copy to host memory (DCP's staging), a background thread pays for
the disk.

When to save is decided here too (``Checkpointer.decide``): by steps (``schedule.periodic_save``),
by minutes, at the last step, and on SIGTERM (the scheduler's walltime warning) a final
synchronous save before the run stops. Ranks see the clock and the signal at slightly different
moments, so the decision is taken from flags every rank voted on together (the step's vote,
``goodput.train.step_vote``: this rank's clock, ``minutes_due``, goes in; SIGTERM or the minutes
on any rank come out); otherwise one rank would enter a save while another entered the next
step, and both would hang.

Where the rank is (``goodput.beacon``): ``save`` is the ``checkpoint-save`` phase; each of its
collectives is bracketed (sites ``ckpt.barrier``, ``ckpt.gather``), and the flush's barriers and
gather are ``ckpt.flush``, on the writer thread's own counters when it runs in the background.

One save at a time: a save asked for while the previous one is still flushing waits for it (the
wait is counted as stall). The state is staged into one host copy kept for the whole run; the
state dict staged there is ``Checkpointer.staged`` until the next save, the source of that
step's in-memory checkpoint (copied from host memory in the background, not from the device
again).
Checkpoint collectives run on their own gloo group, never the training one, so a flush in
flight cannot interleave with training collectives. Its pairs connect on first use
(``groups.lazy_gloo_group``): made, it holds one listening socket a rank. After the first save,
rank 0 — DCP's coordinator, which gathers every rank's plan and scatters the plans back, and
the digests' gatherer — is connected to every rank; every other rank to rank 0, its ring
neighbours (the outcomes' ``all_gather_object``), its barrier peers and its broadcast tree's:
at most 2 ceil(log2 W) + 2 sockets (36 at 127,488 ranks; ``benchmarks/bench_control.py``).
Ranks write in waves of at most ``max_concurrent_writers`` (a barrier between waves), so
thousands of ranks do not open their files on a parallel filesystem in the same second.

Atomicity: every rank writes its RNG file (fsync'd) before the flush; DCP writes each rank's
data (fsync'd), each rank hashes the files it wrote (``checksums``) and hands the digests to rank
0, and then rank 0 writes the ``.metadata`` — only after every rank reported its write done.
Rank 0 then writes ``checksums.json``, ``.complete``, moves ``latest`` and prunes to
``keep_last`` (keeping the milestones of ``keep_every_steps`` too), in that order. The hashing
runs in the flush, so the step's stall is unchanged.
A save that fails on any rank — its small files, DCP's data or the hashing — is reported in one
line naming the checkpoint, the failing ranks and the reason: every rank's outcome is gathered
and handed to all of them (DCP does it for the flush), so all ranks agree it failed. So is one
whose checksums or marker rank 0 cannot write (rank 0 alone acts on those). Either way it gets
no ``.complete``, rank 0 removes its directory, ``latest`` stays where it was, nothing is
pruned, and training goes on: the next save is attempted as usual.

Progress: rank 0 reports the bytes of its own files as DCP writes them (``CountingFileSystem``),
against the tensor bytes its plan holds — plain lines on stderr every 10 s, none for a save
that takes less; every rank writes about as much, so rank 0's share tells how the save goes.

Injected faults (``goodput.faults``) enter through ``WaveWriter``, once this rank's files
of the checkpoint are written: ``save-fail`` raises there, ``ckpt-kill`` kills the rank there.
"""

from __future__ import annotations

import enum
import errno
import functools
import io
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import WriteResult

from goodput import beacon
from goodput.checkpoint.checksums import file_digests, write_checksums
from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.groups import lazy_gloo_group
from goodput.checkpoint.parts import gather
from goodput.checkpoint.schedule import periodic_save
from goodput.checkpoint.state import CheckpointContents, rng_state
from goodput.faults import FaultPlan
from goodput.io import write_json, write_marker, write_text
from goodput.progress import BYTES, Progress, print_line
from goodput.rundir import (
    CONFIG,
    LATEST,
    METADATA,
    TRAIN_STATE,
    list_checkpoints,
    rng_file,
    step_dir,
)

REASONS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only filesystem",
    errno.EIO: "I/O error",
    errno.EFBIG: "file too large",
}


LOW_SPACE_BYTES = 16 * 2**20


class Decision(enum.Enum):
    """What the loop does after a step: the same on every rank."""

    NONE = "none"
    PERIODIC = "periodic"  # save (in the background unless async_save is off), go on
    FINAL = "final"  # SIGTERM: save synchronously, then stop
    STOP = "stop"  # SIGTERM with save_on_sigterm off: stop without saving

    @property
    def saves(self) -> bool:
        return self in (Decision.PERIODIC, Decision.FINAL)

    @property
    def stops(self) -> bool:
        return self in (Decision.FINAL, Decision.STOP)


class CountingFileSystem(FileSystem):
    """DCP's local filesystem, telling ``on_write`` the bytes of each write to a data file."""

    def __init__(self, on_write: Callable[[int], None]) -> None:
        super().__init__()
        self.on_write = on_write

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            yield _CountingStream(stream, self.on_write) if "w" in mode else stream


class _CountingStream(io.IOBase):
    """A file opened for writing whose ``write`` reports its byte count; DCP needs ``tell``
    (each tensor's offset) and ``fileno`` (the fsync) besides."""

    def __init__(self, raw: io.IOBase, on_write: Callable[[int], None]) -> None:
        self.raw, self.on_write = raw, on_write

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        written = self.raw.write(data)
        self.on_write(written)
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        super().close()  # IOBase's close flushes first: the raw file must still be open
        self.raw.close()


class WaveWriter(FileSystemWriter):
    """A DCP filesystem writer whose ranks take turns: at most ``max_writers`` at once. Each
    rank then hashes what it wrote — its data and ``own_files``, the small files it wrote
    before the flush — and rank 0 collects every rank's digests in ``digests``."""

    def __init__(
        self,
        path: Path,
        group: dist.ProcessGroup,
        max_writers: int,
        own_files: list[str],
        fault_hook: Callable[[], None] | None = None,
    ):
        super().__init__(path, sync_files=True)
        self.directory, self.group, self.max_writers = path, group, max_writers
        self.own_files = own_files
        self.fault_hook = fault_hook  # called once this rank's files are written
        self.digests: dict[str, str] = {}
        # DCP writes from the thread calling write_data (thread_count 1): no lock needed.
        self.fs = CountingFileSystem(self._written)
        self._progress: Progress | None = None

    def _written(self, num_bytes: int) -> None:
        if self._progress is not None:
            self._progress.advance(num_bytes)

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        rank, world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        result: torch.futures.Future[list[WriteResult]] | None = None
        error: BaseException | None = None
        for wave in range(-(-world_size // self.max_writers)):
            if wave == rank // self.max_writers:
                try:
                    with Progress(
                        f"checkpoint save {self.directory}",
                        total=_planned_bytes(plan),
                        unit=BYTES,
                        show=rank == 0,
                        live=False,
                    ) as self._progress:
                        result = super().write_data(plan, planner)
                        result.wait()  # written and fsync'd before the next wave starts
                    if self.fault_hook is not None:
                        self.fault_hook()
                except Exception as exc:  # reported through DCP once every wave is through
                    error = exc
                finally:
                    self._progress = None
            with _bracket("ckpt.flush"):  # every rank passes every barrier, failed or not
                dist.barrier(group=self.group)
        # After the last wave, on every rank at once: no wave waits for another's hashing, and
        # the files were just written, so they are mostly read back from the page cache.
        digests: dict[str, str] = {}
        if error is None:
            assert result is not None
            written = sorted({item.storage_data.relative_path for item in result.value()})
            try:
                digests = file_digests(self.directory, [*self.own_files, *written])
            except OSError as exc:
                error = exc
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        with _bracket("ckpt.flush"):  # failed or not
            dist.gather_object(digests, gathered, group=self.group, group_dst=0)
        if gathered is not None:
            self.digests = {name: digest for part in gathered for name, digest in part.items()}
        if error is not None:
            raise error
        assert result is not None
        return result


class RecordingStager(DefaultStager):
    """DCP's stager (synchronous: ``stage`` returns the staged dict), keeping what it staged."""

    def __init__(self, options: StagingOptions) -> None:
        super().__init__(options)
        self.staged: dict[str, Any] | None = None

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> Any:
        staged = super().stage(state_dict, **kwargs)
        assert isinstance(staged, dict), "a synchronous stager returns the staged dict"
        self.staged = staged
        return staged


class Checkpointer:
    """Saves of one run; one instance per rank, created by every rank at the same point."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        root: Path,
        device: torch.device,
        contents: CheckpointContents,
        faults: FaultPlan | None = None,
    ):
        self.cfg, self.root, self.device = cfg, Path(root), device
        self.contents = contents  # what every save writes
        self.faults = faults
        # Collective: every rank, same moment. The flush's group, the checkpoint's alone.
        self.group = lazy_gloo_group()
        self.rank = dist.get_rank()
        self.in_flight: threading.Event | None = None
        self.last_save = time.monotonic()
        # One host copy of the state, reused by every save (the previous flush is always over
        # before the next staging): a fresh 1.3 GB allocation per save tripled the stall of a
        # 100M model (bench_checkpoint). Plain memory, synchronous copy: works without a GPU.
        self.stager = RecordingStager(StagingOptions(False, False, False, False))
        # The state dict the last save staged in host memory; None after a synchronous save.
        self.staged: dict[str, Any] | None = None

    def minutes_due(self) -> bool:
        """Whether the minutes interval has passed since the last save on this rank's clock: its
        flag for the step's vote."""
        minutes = self.cfg.interval_minutes
        return minutes > 0 and time.monotonic() - self.last_save >= 60 * minutes

    def decide(self, step: int, *, last_step: int, sigterm: bool, minutes_due: bool) -> Decision:
        """After ``step``, save or stop? From the flags every rank voted on (``sigterm``,
        ``minutes_due``: true on any rank), so the same on every rank. SIGTERM stops; with an
        interval set, the last step is always saved."""
        if sigterm:
            return Decision.FINAL if self.cfg.save_on_sigterm else Decision.STOP
        interval, minutes = self.cfg.interval_steps, self.cfg.interval_minutes
        if periodic_save(step, interval) or minutes_due:
            return Decision.PERIODIC
        if step == last_step and (interval > 0 or minutes > 0):
            return Decision.PERIODIC
        return Decision.NONE

    def save(self, step: int, *, blocking: bool = False) -> float:
        """Save ``step`` of the registered contents; return the seconds the caller was held
        (wait + staging)."""
        start = time.perf_counter()
        beacon.current().phase("checkpoint-save")
        self.wait()
        self.staged = self.stager.staged = None  # set again only if this save stages
        directory = step_dir(self.root, step)
        error = None
        if self.rank == 0 and directory.exists():
            try:  # left by a failed or killed attempt: never mixed with new files
                shutil.rmtree(directory)
            except OSError as exc:
                error = _reason(exc, directory)
        with beacon.current().collective("ckpt.barrier"):
            dist.barrier(group=self.group)
        contents = self.contents
        model_state, optimizer_state, param_groups = gather(contents.parts, contents.optimizers)
        # The world size decides whether a resume restores each rank's RNG state (load.py).
        train_state = {
            **contents.train_state(),
            "world_size": dist.get_world_size(),
            "optimizer_param_groups": param_groups,
        }
        if not self._write_small_files(directory, step, train_state, contents.config_toml, error):
            return time.perf_counter() - start
        own_files = [str(rng_file(directory, self.rank).relative_to(directory))]
        if self.rank == 0:
            own_files += [TRAIN_STATE, CONFIG]
        fault_hook = None
        if self.faults is not None:
            fault_hook = functools.partial(self.faults.on_checkpoint_write, step, self.rank)
        writer = WaveWriter(
            directory, self.group, self.cfg.max_concurrent_writers, own_files, fault_hook
        )
        # Tensors only: DCP would pickle anything else (the optimizer's param groups), and
        # reading a pickle back runs code. The param groups went to train_state.json instead.
        state = {"model": model_state, "optim": optimizer_state}
        if self.cfg.async_save and not blocking:
            # DCP stages a host copy before returning; the flush runs on its own thread, and so
            # does the finishing (marker, latest, pruning) the moment the flush is through.
            future = dcp.async_save(
                state, storage_writer=writer, process_group=self.group, async_stager=self.stager
            )
            assert isinstance(future, Future)
            self.staged = self.stager.staged
            done = threading.Event()
            future.add_done_callback(lambda f: self._settle(step, writer, f.exception(), done))
            self.in_flight = done
        else:
            try:
                dcp.save(state, storage_writer=writer, process_group=self.group)
            except CheckpointException as exc:
                self._settle(step, writer, exc, None)
            else:
                self._settle(step, writer, None, None)
        self.last_save = time.monotonic()
        held = time.perf_counter() - start
        if self.rank == 0:
            how = "flushing in the background" if self.in_flight else "written synchronously"
            print_line(f"checkpoint: {directory} held training {held:.3f} s ({how})")
        return held

    def _write_small_files(
        self,
        directory: Path,
        step: int,
        train_state: dict[str, Any],
        config_toml: str,
        error: str | None,
    ) -> bool:
        """Each rank's RNG file (rank 0: train state and config); False, reported, if any rank
        failed (``error``: this rank already has) — every rank learns it, so none goes on into
        the flush alone."""
        if error is None:
            try:
                write_json(rng_file(directory, self.rank), rng_state(self.device))
                if self.rank == 0:
                    write_json(directory / TRAIN_STATE, {"step": step, **train_state})
                    write_text(directory / CONFIG, config_toml)
            except OSError as exc:
                error = _reason(exc, directory)
        errors: list[str | None] = [None] * dist.get_world_size(self.group)
        with beacon.current().collective("ckpt.gather"):
            dist.all_gather_object(errors, error, group=self.group)
        failed = {rank: reason for rank, reason in enumerate(errors) if reason is not None}
        if failed:
            self._report_failure(step, failed)
        return not failed

    def wait(self) -> None:
        """Block until the save in flight, if any, is durable and settled (or reported failed)."""
        if self.in_flight is not None:
            self.in_flight.wait()
            self.in_flight = None

    def close(self) -> None:
        self.wait()
        self.stager.close()
        dist.destroy_process_group(self.group)

    def _settle(
        self,
        step: int,
        writer: WaveWriter,
        error: BaseException | None,
        done: threading.Event | None,
    ) -> None:
        try:
            if error is None:
                self._finish(step, writer.digests)
            elif isinstance(error, CheckpointException):
                directory = step_dir(self.root, step)
                reasons = {
                    rank: _reason(exc, directory) for rank, (exc, _) in error.failures.items()
                }
                self._report_failure(step, reasons)
            else:
                self._report_failure(step, {self.rank: _reason(error, step_dir(self.root, step))})
        finally:
            if done is not None:
                done.set()

    def _finish(self, step: int, digests: dict[str, str]) -> None:
        if self.rank != 0:
            return
        directory = step_dir(self.root, step)
        try:
            # DCP wrote .metadata on rank 0 after every rank's data: the one file no writer
            # hashed.
            write_checksums(directory, {**digests, **file_digests(directory, [METADATA])})
            write_marker(directory)
        except OSError as exc:  # only rank 0 gets here, and only rank 0 acts on the outcome
            self._report_failure(step, {self.rank: _reason(exc, directory)})
            return
        write_text(self.root / LATEST, directory.name + "\n")
        checkpoints = list_checkpoints(self.root)
        kept = kept_steps([c.step for c in checkpoints if c.complete], self.cfg)
        for old in checkpoints:
            # Older complete ones neither among the last nor milestones, and leftovers of killed
            # or failed attempts.
            if old.step < step and old.step not in kept:
                shutil.rmtree(old.path, ignore_errors=True)
        print_line(f"checkpoint: {directory} complete")

    def _report_failure(self, step: int, reasons_by_rank: dict[int, str]) -> None:
        directory = step_dir(self.root, step)
        ranks = ", ".join(map(str, sorted(reasons_by_rank)))
        reasons = "; ".join(sorted(set(reasons_by_rank.values())))
        report = (
            f"checkpoint: saving {directory} FAILED on rank(s) {ranks}: {reasons}; "
            "previous checkpoints are intact, training goes on"
        )
        if self.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
            print_line(report)


def kept_steps(complete: list[int], cfg: CheckpointConfig) -> set[int]:
    """The steps of the ``complete`` checkpoints that pruning keeps: the newest ``keep_last``,
    and every milestone (a step that is a multiple of ``keep_every_steps``, when set)."""
    kept = set(sorted(complete)[-cfg.keep_last :])
    every = cfg.keep_every_steps
    return kept | ({step for step in complete if step % every == 0} if every else set())


def _planned_bytes(plan: SavePlan) -> int:
    """The tensor bytes of this rank's plan: what it writes, less torch's framing of each."""
    return sum(
        math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
        for item in plan.items
        if item.tensor_data is not None
    )


def _bracket(site: str) -> Any:
    """A flush collective's bracket: the writer thread's counters when it runs in the background
    (``dcp.async_save``), the training thread's when the save is synchronous."""
    current = beacon.current()
    if threading.current_thread() is threading.main_thread():
        return current.collective(site)
    return current.flush_collective(site)


def _reason(error: BaseException, directory: Path) -> str:
    if isinstance(error, OSError) and error.errno in REASONS:
        return f"{REASONS[error.errno]} ({error})"
    reason = f"{type(error).__name__}: {' '.join(str(error).split())}"
    # torch's zip writer turns ENOSPC into a RuntimeError about file positions; say what it is.
    free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    if free < LOW_SPACE_BYTES:
        return f"disk full ({free // 1024} KiB free; {reason})"
    return reason
