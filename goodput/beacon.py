"""The per-rank beacon: where each rank is (step, phase, last collective) and how long it waited,
readable by another process while the rank is stopped, hung or stuck in the kernel.

One beacon per process (as with faulthandler), reached through ``current()``, so step, pipeline,
eval and checkpoint need no extra argument. Its counters are always kept: in process memory
until ``open_beacon`` (or without it: plain ``torchrun``, where the loop still needs the waits
for busy time), then in the file ``beacon_path(dir, rank)`` that ``open_beacon`` maps shared.

The file: one fixed 256-byte little-endian struct (``_LAYOUT``), written under a temporary name
and renamed into place, then updated in place through ``mmap`` (MAP_SHARED) under a seqlock: an
update makes ``seq`` odd, packs the fields, makes it even again. A reader retries a few times
until ``seq`` is even and unchanged; a rank stopped mid-update leaves it odd forever, and the
reader returns the fields with ``torn=True`` (the counters only grow, so they are still usable:
each update is packed aside and copied in, never zeroed in place first).
(x86 keeps the stores in order; on a weaker memory model a read may mix two neighbouring
updates, each field still one of the values it held.)
An update costs about a microsecond and needs no syscall, no collective and no thread; a rank
that is SIGSTOPped, killed or in D state leaves its last values in the page cache.

Clocks: ``phase_since_ns`` and ``updated_ns`` are CLOCK_MONOTONIC, comparable between the
processes of one host only (forensics runs on each host).

Collectives: ``with beacon.collective(site)`` counts ``entered`` before and ``left`` after, and
adds the time inside to ``waited_ns`` (the outermost bracket only, so nested brackets do not
count twice). It is for the training thread; the checkpoint writer's thread has its own
counters, ``with beacon.flush_collective(site)``, which add no wait (the loop's busy time is
the training thread's). A lock orders the two threads' updates (an RLock: a Python signal
handler on the training thread may update while the thread is inside one).

Stacks: ``open_beacon`` registers ``faulthandler`` on ``DUMP_SIGNAL`` writing every thread's
stack to ``stack_path(dir, rank)``, whose first line is ``STACK_HEADER`` (so a launcher deletes
only stack files goodput wrote). faulthandler's handler is C-level: it writes while the main
thread is blocked inside a C call.

Flight recorder: when ``TORCH_FR_BUFFER_SIZE`` or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is above 0,
``open_beacon`` also starts a daemon thread that looks every ``FR_POLL_S`` whether the stack
file grew; once faulthandler wrote to it, the thread writes torch's flight record (every
collective's ``collective_seq_id`` per process group, its ``profiling_name`` and state) to
``fr_path(dir, rank)``, atomically. It runs during a hang: gloo and NCCL release the GIL while
they wait. This module never imports torch: the thread uses it only if the rank already did.

Reading is strict and bounded (``read_beacon``): a regular file, not a symlink, owned by this
user, of exactly the struct's size, with the magic, the version, in-range fields and zero
reserved bytes; anything else is a ``GoodputError`` naming the file. The reader never trusts
the pid: checking it against ``start_ticks`` before signalling it is the caller's job.

Standard library only: ``train``, ``checkpoint`` and ``launch`` import this module; it imports
none of them, nor torch.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from goodput.errors import GoodputError, printable
from goodput.io import NotOwnFile, open_own_file
from goodput.ranks import BEACON_DIR_VAR

DUMP_SIGNAL = signal.SIGUSR2
PHASES = (
    "startup",
    "data",
    "forward",
    "backward",
    "optimizer",
    "vote",
    "eval",
    "metrics",
    "checkpoint-save",
    "done",
)
# Every place a rank can wait on its peers. A new collective gets a new site here (append only:
# the file stores a site as its index + 1, 0 meaning none yet). step.*: train/step.py (step.pp
# also pipeline.py); fsdp.*: train/parallel/collectives.py; ckpt.*: checkpoint/save.py, but
# ckpt.vote, the step's vote (train/step_vote.py); busy.window: the straggler watch's window
# (train/monitor/stragglers.py); eval.sums: eval/heldout.py and the pipeline's
# eval; optim.reduce: the optimizers' own reductions (Muon, Mano, SophiaG's shard sums) and
# QK-clip's.
SITES = (
    "step.tokens",
    "step.grads",
    "step.sums",
    "step.moe",
    "step.norm",
    "step.pp",
    "fsdp.all_gather",
    "fsdp.reduce_scatter",
    "ckpt.vote",
    "ckpt.barrier",
    "ckpt.gather",
    "ckpt.flush",
    "eval.sums",
    "optim.reduce",
    "busy.window",
)
STACK_HEADER = b"# goodput stacks\n"
FR_SIZE_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_POLL_S = 0.5

MAGIC = b"GPBEACN\x01"
VERSION = 1
SIZE = 256
HOST_BYTES = 64
READ_TRIES = 5
MAX_WORLD = 1 << 24
MAX_PID = 1 << 22  # Linux's pid_max ceiling

_I64_MAX = (1 << 63) - 1
# Static part (written once): magic, version, size, reserved, seq, rank, world, pid, local rank,
# start ticks, main thread id, host, schedule id. Dynamic part (every update): step, phase,
# last site, flush site, 5 reserved bytes, phase since, entered, left, waited, flush entered,
# flush left, updated; then reserved bytes to SIZE.
_HEAD = struct.Struct("<8sHHI")
_SEQ = struct.Struct("<Q")
_STATIC = struct.Struct(f"<IIIIQQ{HOST_BYTES}sQ")
_DYNAMIC = struct.Struct("<qBBB5xqQQQQQq")
_SEQ_AT = _HEAD.size
_STATIC_AT = _SEQ_AT + _SEQ.size
_DYNAMIC_AT = _STATIC_AT + _STATIC.size
_RESERVED_AT = _DYNAMIC_AT + _DYNAMIC.size
assert _RESERVED_AT <= SIZE
_PHASE_CODE = {name: code for code, name in enumerate(PHASES)}
_SITE_CODE = {name: code + 1 for code, name in enumerate(SITES)}


@dataclass(frozen=True, slots=True, kw_only=True)
class BeaconState:
    """One beacon as read back. ``last_site``/``flush_site`` are "" before the first bracket."""

    rank: int
    world_size: int
    pid: int
    local_rank: int
    start_ticks: int
    main_thread_id: int
    host: str
    schedule_id: int
    step: int
    phase: str
    last_site: str
    phase_since_ns: int
    entered: int
    left: int
    waited_ns: int
    flush_site: str
    flush_entered: int
    flush_left: int
    updated_ns: int
    torn: bool


def beacon_path(directory: Path | str, rank: int) -> Path:
    """``DIR/rank-00003.beacon``."""
    return Path(directory) / f"rank-{rank:05d}.beacon"


def stack_path(directory: Path | str, rank: int) -> Path:
    """``DIR/rank-00003.stack``: faulthandler's dump on ``DUMP_SIGNAL``, after ``STACK_HEADER``."""
    return Path(directory) / f"rank-{rank:05d}.stack"


def fr_path(directory: Path | str, rank: int) -> Path:
    """``DIR/rank-00003.fr.json``: torch's flight record, written after a stack dump (JSON)."""
    return Path(directory) / f"rank-{rank:05d}.fr.json"


class _Bracket:
    """``with``-form of one site's enter/leave; one object per site, reused (no allocation)."""

    __slots__ = ("_enter", "_leave", "_code")

    def __init__(self, enter: Callable[[int], None], leave: Callable[[], None], code: int) -> None:
        self._enter = enter
        self._leave = leave
        self._code = code

    def __enter__(self) -> None:
        self._enter(self._code)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave()


class Beacon:
    """The process's counters, in memory or in the mapped file (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._buffer: bytearray | mmap.mmap = bytearray(SIZE)
        _HEAD.pack_into(self._buffer, 0, MAGIC, VERSION, SIZE, 0)
        self._seq = 0
        self._step = 0
        self._phase = 0
        self._last_site = 0
        self._flush_site = 0
        self._phase_since_ns = time.monotonic_ns()
        self._entered = 0
        self._left = 0
        self._waited_ns = 0
        self._flush_entered = 0
        self._flush_left = 0
        self._depth = 0
        self._outer_start_ns = 0
        self._files: _Files | None = None
        self._static: tuple[object, ...] = ()  # what open_beacon wrote, for set_schedule
        self._brackets = {s: _Bracket(self._enter, self._leave, c) for s, c in _SITE_CODE.items()}
        self._flush_brackets = {
            s: _Bracket(self._flush_enter, self._flush_leave, c) for s, c in _SITE_CODE.items()
        }

    @property
    def waited_ns(self) -> int:
        """Total ns the training thread spent inside (outermost) collective brackets."""
        return self._waited_ns

    @property
    def path(self) -> Path | None:
        """The beacon file while open, else None."""
        return None if self._files is None else self._files.beacon

    def step(self, n: int) -> None:
        """The training step this rank is on."""
        with self._lock:
            self._step = n
            self._publish()

    def phase(self, name: str) -> None:
        """Enter phase ``name`` (one of ``PHASES``)."""
        code = _PHASE_CODE.get(name)
        if code is None:
            raise ValueError(f"unknown beacon phase {name!r}; one of {', '.join(PHASES)}")
        with self._lock:
            self._phase = code
            self._phase_since_ns = time.monotonic_ns()
            self._publish()

    def set_schedule(self, schedule_id: int) -> None:
        """The rank's schedule id, once its layout is built (the beacon opens before: a hang
        while the model is built or a checkpoint loaded has a beacon too)."""
        with self._lock:
            if not self._static:
                return  # no file: nothing reads it
            self._static = (*self._static[:-1], schedule_id & ((1 << 64) - 1))
            self._seq += 1  # odd while the static part changes: a reader retries
            _SEQ.pack_into(self._buffer, _SEQ_AT, self._seq)
            self._buffer[_STATIC_AT : _STATIC_AT + _STATIC.size] = _STATIC.pack(*self._static)
            self._seq += 1
            _SEQ.pack_into(self._buffer, _SEQ_AT, self._seq)

    def collective(self, site: str) -> _Bracket:
        """``with beacon.collective(site):`` around one wait on the peers (training thread)."""
        return _lookup(self._brackets, site)

    def flush_collective(self, site: str) -> _Bracket:
        """``with beacon.flush_collective(site):`` in the checkpoint writer's thread."""
        return _lookup(self._flush_brackets, site)

    def close(self) -> None:
        """Unlink this process's own files and keep counting in memory. A forked child (a data
        loader worker) inherits the mapping but never owns the files: it does nothing."""
        with self._lock:
            files = self._files
            if files is None or files.pid != os.getpid():
                return
            self._files = None
            self._static = ()
            memory = bytearray(self._buffer[:SIZE])
            mapped = self._buffer
            self._buffer = memory
            assert isinstance(mapped, mmap.mmap)
            mapped.close()
            files.remove()

    def _enter(self, code: int) -> None:
        with self._lock:
            if self._depth == 0:
                self._outer_start_ns = time.monotonic_ns()
            self._depth += 1
            self._entered += 1
            self._last_site = code
            self._publish()

    def _leave(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._waited_ns += time.monotonic_ns() - self._outer_start_ns
            self._left += 1
            self._publish()

    def _flush_enter(self, code: int) -> None:
        with self._lock:
            self._flush_entered += 1
            self._flush_site = code
            self._publish()

    def _flush_leave(self) -> None:
        with self._lock:
            self._flush_left += 1
            self._publish()

    def _publish(self) -> None:
        # The seqlock write; the caller holds the lock.
        buffer = self._buffer
        self._seq += 1
        _SEQ.pack_into(buffer, _SEQ_AT, self._seq)
        # Packed aside, then copied in: ``pack_into`` zeroes its span before it writes the
        # fields, and a rank stopped between the two would leave a torn beacon of zeros.
        buffer[_DYNAMIC_AT : _DYNAMIC_AT + _DYNAMIC.size] = _DYNAMIC.pack(
            self._step,
            self._phase,
            self._last_site,
            self._flush_site,
            self._phase_since_ns,
            self._entered,
            self._left,
            self._waited_ns,
            self._flush_entered,
            self._flush_left,
            time.monotonic_ns(),
        )
        self._seq += 1
        _SEQ.pack_into(buffer, _SEQ_AT, self._seq)

    def _attach(
        self, directory: Path, static: tuple[object, ...], rank: int, *, recorder: bool
    ) -> None:
        # Called by open_beacon: write the file under a temporary name, map it, rename it in.
        self.close()  # opened again (a second run in one process): the new rank's files only
        with self._lock:
            image = bytearray(self._buffer)
            _STATIC.pack_into(image, _STATIC_AT, *static)
            self._static = static
            stacks = _create_stack_file(stack_path(directory, rank))
            # Before the beacon appears: a launcher that finds it may signal at once, and
            # SIGUSR2's default action would end the rank.
            faulthandler.register(DUMP_SIGNAL, file=stacks.file, all_threads=True, chain=False)
            final = beacon_path(directory, rank)
            mapped, identity = _create_mapped(final, bytes(image))
            watcher = _FlightRecorder(stacks, fr_path(directory, rank)) if recorder else None
            self._files = _Files(
                beacon=final, identity=identity, stacks=stacks, pid=os.getpid(), recorder=watcher
            )
            self._buffer = mapped
            self._publish()
        if watcher is not None:
            watcher.start()


def _lookup(brackets: dict[str, _Bracket], site: str) -> _Bracket:
    bracket = brackets.get(site)
    if bracket is None:
        raise ValueError(f"unknown beacon site {site!r}; add it to goodput.beacon.SITES")
    return bracket


@dataclass(kw_only=True, slots=True)
class _StackFile:
    path: Path
    file: IO[bytes]
    identity: tuple[int, int]


@dataclass(kw_only=True, slots=True)
class _Files:
    beacon: Path
    identity: tuple[int, int]
    stacks: _StackFile
    pid: int
    recorder: _FlightRecorder | None

    def remove(self) -> None:
        faulthandler.unregister(DUMP_SIGNAL)
        if self.recorder is not None:
            self.recorder.stop()
        self.stacks.file.close()
        _unlink_if_same(self.beacon, self.identity)
        _unlink_if_same(self.stacks.path, self.stacks.identity)


class _FlightRecorder(threading.Thread):
    """Writes torch's flight record each time the stack file grows (see the module docstring)."""

    def __init__(self, stacks: _StackFile, path: Path) -> None:
        super().__init__(name="goodput-flight-recorder", daemon=True)
        self.stacks, self.path = stacks, path
        self.written: tuple[int, int] | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        seen = len(STACK_HEADER)
        while not self.stopping.wait(FR_POLL_S):
            size = os.fstat(self.stacks.file.fileno()).st_size  # our fd: renames cannot fool it
            if size > seen:
                seen = size
                self._write()

    def _write(self) -> None:
        record = _flight_record()
        if record is None:
            return
        temporary = _temporary(self.path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temporary, flags, 0o600)
        try:
            os.write(fd, record)
            info = os.fstat(fd)
        finally:
            os.close(fd)
        os.replace(temporary, self.path)
        self.written = (info.st_dev, info.st_ino)

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=2 * FR_POLL_S)
        if self.written is not None:
            _unlink_if_same(self.path, self.written)


def _flight_record() -> bytes | None:
    """torch's flight record as JSON bytes; None when torch is not loaded or has none."""
    torch = sys.modules.get("torch")  # imported by the rank, never here
    c10d = getattr(getattr(torch, "_C", None), "_distributed_c10d", None)
    dump = getattr(c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return None
    try:
        record = dump()
    except RuntimeError:  # no process group (yet, or any more)
        return None
    return record if isinstance(record, bytes) else None


def _unlink_if_same(path: Path, identity: tuple[int, int]) -> None:
    # Delete only the file this process created: another may have been renamed over it.
    try:
        info = os.lstat(path)
        if (info.st_dev, info.st_ino) == identity:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _create_mapped(path: Path, image: bytes) -> tuple[mmap.mmap, tuple[int, int]]:
    temporary = _temporary(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o600)
    try:
        os.write(fd, image)
        mapped = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        info = os.fstat(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    return mapped, (info.st_dev, info.st_ino)


def _create_stack_file(path: Path) -> _StackFile:
    temporary = _temporary(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_APPEND
    fd = os.open(temporary, flags, 0o600)
    file = os.fdopen(fd, "ab", buffering=0)
    file.write(STACK_HEADER)
    info = os.fstat(fd)
    os.replace(temporary, path)
    return _StackFile(path=path, file=file, identity=(info.st_dev, info.st_ino))


_CURRENT = Beacon()


def current() -> Beacon:
    """The process's one beacon (counting in memory until ``open_beacon``)."""
    return _CURRENT


def open_beacon(
    environ: Mapping[str, str],
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    host: str,
    schedule_id: int = 0,
) -> Beacon | None:
    """With ``GOODPUT_BEACON_DIR`` set: move ``current()``'s counters into this rank's file,
    register the stack dump on ``DUMP_SIGNAL``, and return ``current()``. None when unset."""
    value = environ.get(BEACON_DIR_VAR, "")
    if not value:
        return None
    directory = _beacon_dir(value)
    if not (0 <= rank < world_size <= MAX_WORLD and 0 <= local_rank < MAX_WORLD):
        raise GoodputError(
            BEACON_DIR_VAR, f"rank {rank} of world {world_size} is out of range", "a launcher bug"
        )
    static = (
        rank,
        world_size,
        os.getpid(),
        local_rank,
        _start_ticks(),
        threading.main_thread().ident or 0,
        _host_bytes(host),
        schedule_id & ((1 << 64) - 1),
    )
    _CURRENT._attach(directory, static, rank, recorder=_flight_recorder_on(environ))
    return _CURRENT


def _flight_recorder_on(environ: Mapping[str, str]) -> bool:
    for name in FR_SIZE_VARS:
        try:
            if int(environ.get(name, "0") or "0") > 0:
                return True
        except ValueError:
            pass  # torch reads these too and says what it makes of a bad one
    return False


def _beacon_dir(value: str) -> Path:
    directory = Path(value)
    fix = f"set {BEACON_DIR_VAR} to an absolute path of a folder of yours, or unset it"
    if not directory.is_absolute():
        raise GoodputError(BEACON_DIR_VAR, f"{value!r} is not an absolute path", fix)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(directory)
    except OSError as error:
        raise GoodputError(directory, f"cannot create the beacon folder: {error}", fix) from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise GoodputError(directory, "is not a folder of this user (or is a symlink)", fix)
    return directory


def _host_bytes(host: str) -> bytes:
    # Cut at a character boundary; the reader needs printable UTF-8.
    data = printable(host, HOST_BYTES).encode()[:HOST_BYTES]
    return data.decode(errors="ignore").encode()


def _start_ticks() -> int:
    """Field 22 of /proc/self/stat (start time in clock ticks since boot); 0 off Linux."""
    try:
        with open("/proc/self/stat", "rb") as file:
            text = file.read(4096)
    except OSError:
        return 0
    return int(text[text.rindex(b")") + 2 :].split()[19])


def read_beacon(path: Path | str) -> BeaconState:
    """The beacon in ``path``, strictly checked; a file that is not one is a GoodputError."""
    path = Path(path)
    try:
        fd, _ = open_own_file(path)
    except NotOwnFile as refused:
        raise _not_beacon(path, f"cannot open it: it {refused.reason}") from None
    try:
        image, torn = _read_consistent(fd, path)
    finally:
        os.close(fd)
    return _decode(image, path, torn)


def _read_consistent(fd: int, path: Path) -> tuple[bytes, bool]:
    image = b""
    for attempt in range(READ_TRIES):
        try:
            image = os.pread(fd, SIZE + 1, 0)
            after = os.pread(fd, _SEQ.size, _SEQ_AT)
        except OSError as error:
            raise _not_beacon(path, f"cannot read it ({error.strerror or error})") from None
        if len(image) != SIZE:
            raise _not_beacon(path, f"{len(image)} bytes, not {SIZE}")
        seq = image[_SEQ_AT : _SEQ_AT + _SEQ.size]
        if seq == after and _SEQ.unpack(seq)[0] % 2 == 0:
            return image, False
        time.sleep(0.0002 * (attempt + 1))
    return image, True


def _decode(image: bytes, path: Path, torn: bool) -> BeaconState:
    magic, version, size, reserved_head = _HEAD.unpack_from(image, 0)
    if magic != MAGIC:
        raise _not_beacon(path, "wrong magic")
    if version != VERSION or size != SIZE:
        raise _not_beacon(path, f"version {version} size {size}, not {VERSION} and {SIZE}")
    if reserved_head or any(image[_RESERVED_AT:]):
        raise _not_beacon(path, "reserved bytes are not zero")
    rank, world, pid, local_rank, start_ticks, thread, host, schedule = _STATIC.unpack_from(
        image, _STATIC_AT
    )
    (step, phase, site, flush_site, *counters) = _DYNAMIC.unpack_from(image, _DYNAMIC_AT)
    phase_since, entered, left, waited, flush_entered, flush_left, updated = counters
    if not (0 <= rank < world <= MAX_WORLD and 0 <= local_rank < MAX_WORLD and 0 < pid < MAX_PID):
        raise _not_beacon(
            path, f"rank {rank}, world {world}, local rank {local_rank} or pid {pid} out of range"
        )
    if phase >= len(PHASES) or site > len(SITES) or flush_site > len(SITES):
        raise _not_beacon(path, f"phase {phase} or site {site}/{flush_site} unknown")
    if step < 0 or min(counters) < 0 or max(counters) > _I64_MAX:
        raise _not_beacon(path, "a negative or overflowing counter")
    return BeaconState(
        rank=rank,
        world_size=world,
        pid=pid,
        local_rank=local_rank,
        start_ticks=start_ticks,
        main_thread_id=thread,
        host=_decode_host(host, path),
        schedule_id=schedule,
        step=step,
        phase=PHASES[phase],
        last_site=_site_name(site),
        phase_since_ns=phase_since,
        entered=entered,
        left=left,
        waited_ns=waited,
        flush_site=_site_name(flush_site),
        flush_entered=flush_entered,
        flush_left=flush_left,
        updated_ns=updated,
        torn=torn,
    )


def _site_name(code: int) -> str:
    return SITES[code - 1] if code else ""


def _decode_host(raw: bytes, path: Path) -> str:
    data = raw.rstrip(b"\0")
    try:
        host = data.decode()
    except UnicodeDecodeError:
        raise _not_beacon(path, "host is not UTF-8") from None
    if not host.isprintable():
        raise _not_beacon(path, "host is not printable")
    return host


def _not_beacon(path: Path, what: str) -> GoodputError:
    return GoodputError(
        path, f"not a goodput beacon: {what}", "delete it; only goodput writes beacon files"
    )
