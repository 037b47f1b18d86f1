"""In-process recovery, the rank's side (``goodput launch --in-process``; the launcher's side is
``goodput.launch.inprocess``).

A rank whose peer dies does not exit. It leaves the step it is in, keeps its process (the
interpreter, torch and goodput imported, the device context) and enters ``loop.train`` again on
a new generation of the process groups, whose resume loads the newest in-memory checkpoint every
rank committed (the snapshot store's restore, verified as at any restart). The dead rank's place
is taken by a warm spare: a ``goodput train`` process started beforehand with
``GOODPUT_SPARE`` set, its imports done, waiting for the launcher to give it a rank. As
NVIDIA's in-process restart does, the training function is entered again rather than repaired:
FSDP2 and DTensor bind their process groups when the model is wrapped, so the model and
optimizer are built again on the new groups (on the demo this is a fraction of the cost of a new
process: ``docs/benchmarks.md``).

The launcher hosts the recovery store (torch's ``TCPStore``; address in ``GOODPUT_RECOVERY_STORE``),
which outlives any rank. Its keys, for generation ``g``:

- ``gen/g/``: the prefix of generation g's process groups (``setup_torch`` initialises the
  default group on it);
- ``wake/g/RANK``: ``abort``, set by the launcher for every rank when a rank of generation g
  died; this rank's watcher (a thread blocked on this key alone, so the store serves one waiting
  request a rank, and nothing polls) then shuts down the process's connected TCP sockets but the
  store's own. The rank sets ``done`` itself once it leaves the generation otherwise. Why
  sockets: torch 2.13's gloo ``abort()`` and ``shutdown()`` leave a collective waiting on a live
  peer until its timeout (measured: ``tests/unit/train/test_recovery.py``); a socket shut down
  under it is a closed peer, which gloo reports at once. Where the backend is NCCL or xccl,
  torch's abort of every group comes first.
- ``left/g/RANK``: this rank has left generation g and waits; it adds 1 to ``left/g`` too,
  the count the launcher polls (one read a poll, whatever the world size);
- ``next/g``: the launcher's answer, JSON: ``{"generation": g + 1}`` once every rank of the next
  generation is waiting, or ``{"fallback": "why"}``, after which the rank exits and the
  launcher restarts every process as without ``--in-process``;
- ``spare/ID``: JSON ``{"rank": R, "generation": G}``, the spare's assignment;
- ``joined/g/RANK``: generation g's default group is up on this rank (the rendezvous's end,
  which the launcher times), counted in ``joined/g`` as ``left/g`` is.

Every value read from the store is parsed strictly and bounded, as a file from disk would be.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from goodput.errors import ExitCode, GoodputError
from goodput.launch.env import launcher_rank
from goodput.progress import print_line
from goodput.ranks import RECOVERY_STORE_VAR, SPARE_VAR, parse_spare_id, parse_store_address
from goodput.train import generation
from goodput.train.config.run import RunConfig
from goodput.train.device import detect_device_type
from goodput.train.generation import Generation
from goodput.train.metrics import peak_flops
from goodput.train.parallel.parallelize import compute_dtype

MAX_VALUE_BYTES = 4096  # any value this protocol stores is a short JSON object
WAIT_SLICE_S = 30.0  # a store wait is re-issued this often (so a gone launcher is noticed)
CONNECT_TIMEOUT_S = 60.0
ABORT_WAIT_S = 5.0  # the launcher sees an exit within 0.05 s; this is the margin for a busy host


class Link:
    """This process's connections to the launcher's recovery store: one for the main thread,
    one for the watcher (a client is not shared between threads)."""

    def __init__(self, address: tuple[str, int]):
        self.store_peers = store_peers(address)
        self.main = _client(address)
        self.watcher_client = _client(address)

    def wait_value(self, key: str) -> dict[str, Any]:
        """The JSON object at ``key`` once it is set (waiting in slices; a launcher gone is the
        store's network error, raised)."""
        while True:
            try:
                self.main.wait([key], datetime.timedelta(seconds=WAIT_SLICE_S))
                break
            except dist.DistStoreError:  # the slice ran out: the store is still there
                continue
        return parse_value(key, self.main.get(key))


def parse_value(key: str, raw: bytes) -> dict[str, Any]:
    """A value of the recovery store: a JSON object of at most ``MAX_VALUE_BYTES``."""
    if len(raw) > MAX_VALUE_BYTES:
        raise _bad(key, f"{len(raw)} bytes, more than {MAX_VALUE_BYTES}")
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(key, f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise _bad(key, "not a JSON object")
    return value


def int_field(key: str, value: dict[str, Any], field: str, low: int, high: int) -> int:
    number = value.get(field)
    if type(number) is not int or not low <= number <= high:
        raise _bad(key, f"{field} {number!r} is not an integer in [{low}, {high}]")
    return number


def _bad(key: str, why: str) -> GoodputError:
    return GoodputError(
        "recovery store",
        f"key {key}: {why}",
        "the store is the launcher's: relaunch with goodput launch --in-process",
    )


def _client(address: tuple[str, int]) -> dist.TCPStore:
    host, port = address
    return dist.TCPStore(
        host,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S),
        wait_for_workers=False,
    )


def train_in_process(train: Any, cfg: RunConfig) -> list[float]:
    """``train(cfg)`` under in-process recovery: entered again on a new generation each time a
    peer dies, until it returns or the launcher answers with a fallback. A spare first waits
    for its rank."""
    link = Link(parse_store_address(os.environ[RECOVERY_STORE_VAR]))
    rank, world_size = launcher_rank(os.environ)  # a spare's RANK is unset: its rank comes later
    number = 0
    spare = os.environ.get(SPARE_VAR)
    if spare is not None:
        _warm_up(cfg)
        rank, number = _await_assignment(link, parse_spare_id(spare), world_size)
    while True:
        # One line a rank: the local launcher's handful (the only one that keeps spares).
        print_line(f"train: rank {rank}, pid {os.getpid()}, generation {number}")
        generation.enter(Generation(number, link.main, rank))
        watcher = Watcher(link, number, rank)
        try:
            losses = train(cfg)
            watcher.join()
            return losses
        except GoodputError:
            watcher.join()
            raise  # a decision (a stop, a refusal) the ranks took alike: the run ends as it would
        except Exception as error:  # noqa: BLE001 - judged below: a peer's death or our own
            # A peer's death reaches the ranks connected to it before the launcher has seen
            # the exit and set the abort key: wait for that key a moment.
            if not watcher.fired.wait(ABORT_WAIT_S):
                watcher.join()
                raise  # no rank died: this rank's own error, which ends it as without recovery
            print_line(
                f"train: rank {rank} leaves generation {number} (a peer died: "
                f"{type(error).__name__}); waiting for the launcher"
            )
            del error  # its traceback holds the old groups and the model
        finally:
            generation.leave()
        watcher.join()
        gc.collect()  # the old groups' sockets close with their last reference
        link.main.set(f"left/{number}/{rank}", str(os.getpid()))
        link.main.add(f"left/{number}", 1)
        answer = link.wait_value(f"next/{number}")
        if "fallback" in answer:
            raise GoodputError(
                "train",
                f"in-process recovery of generation {number} gave up: {answer['fallback']}",
                "the launcher restarts every rank from the newest checkpoint",
                code=ExitCode.ERROR,
            )
        number = int_field(f"next/{number}", answer, "generation", number + 1, number + 1)


def _warm_up(cfg: RunConfig) -> None:
    """What a warm spare does before it waits, so that its start after a death need not: on a
    CPU, the matmul probe that MFU is measured against (half a second, cached for the
    process). A device's figure comes from its datasheet."""
    if detect_device_type() == "cpu":
        peak_flops(torch.device("cpu"), compute_dtype(cfg.parallel), cfg.train.peak_tflops)


def _await_assignment(link: Link, spare_id: int, world_size: int) -> tuple[int, int]:
    """A warm spare's wait: (the rank it takes, the generation it joins)."""
    key = f"spare/{spare_id}"
    print_line(f"train: warm spare {spare_id} ready (pid {os.getpid()})")
    value = link.wait_value(key)
    rank = int_field(key, value, "rank", 0, world_size - 1)
    generation = int_field(key, value, "generation", 1, 1 << 30)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    print_line(f"train: warm spare {spare_id} takes rank {rank} in generation {generation}")
    return rank, generation


class Watcher:
    """A daemon thread blocked on this rank's ``wake/NUMBER/RANK`` (one waiting request a rank,
    no polling): ``abort`` (the launcher's) shuts down every connected TCP socket of this
    process but the store's (see the module docstring); ``done`` (this rank's own, once it
    left the generation) ends the thread."""

    def __init__(self, link: Link, number: int, rank: int):
        self.link, self.key = link, f"wake/{number}/{rank}"
        self.fired = threading.Event()
        self.thread = threading.Thread(target=self._run, name="goodput-recovery", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        client = self.link.watcher_client
        try:
            while True:
                try:
                    client.wait([self.key], datetime.timedelta(seconds=WAIT_SLICE_S))
                    break
                except dist.DistStoreError:
                    continue
            if client.get(self.key) != b"abort":
                return
        except Exception:  # noqa: BLE001 - the store gone: the launcher is, too
            return
        self.fired.set()
        abort_groups(self.link.store_peers)

    def join(self) -> None:
        """End the thread: after the abort it ran, or by this rank's own ``done``."""
        if not self.fired.is_set():
            with contextlib.suppress(Exception):
                self.link.main.compare_set(self.key, "", "done")
        self.thread.join()


def abort_groups(store: frozenset[tuple[str, int]]) -> int:
    """Make every collective of this process's groups fail now: torch's abort where the backend
    has one that does (NCCL, xccl), then every connected TCP socket but the store's shut down.
    Returns how many sockets were shut down."""
    if dist.is_initialized() and dist.get_backend() not in ("gloo",):
        with contextlib.suppress(Exception):
            dist.distributed_c10d._abort_process_group()
    shut = 0
    for fd in _socket_fds():
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
                if tcp and sock.type == socket.SOCK_STREAM:
                    peer = sock.getpeername()
                    if not _is_store(peer, store):
                        sock.shutdown(socket.SHUT_RDWR)
                        shut += 1
            finally:
                sock.close()
    return shut


def _socket_fds() -> list[int]:
    fds = []
    folder = Path("/proc/self/fd")
    for entry in folder.iterdir():
        with contextlib.suppress(OSError, ValueError):
            if os.readlink(entry).startswith("socket:"):
                fds.append(int(entry.name))
    return fds


def store_peers(address: tuple[str, int]) -> frozenset[tuple[str, int]]:
    """The (IP, port) pairs a connection to the store has as its peer."""
    host, port = address
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return frozenset((_plain_ip(str(info[4][0])), port) for info in infos)


def _is_store(peer: Any, store: frozenset[tuple[str, int]]) -> bool:
    return isinstance(peer, tuple) and (_plain_ip(peer[0]), peer[1]) in store


def _plain_ip(ip: str) -> str:
    """An IPv4 address however the socket spells it (``::ffff:10.0.0.1`` is ``10.0.0.1``)."""
    return ip.removeprefix("::ffff:")
