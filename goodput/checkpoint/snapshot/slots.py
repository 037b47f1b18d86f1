"""This rank's slot files of one run's in-memory checkpoints, shared by taking them (``store``) and
the restart (``restore``): where they are, which are committed, mapping them, a partner's copy
received into one, and what is deleted when.

Slots. A rank keeps two payload files of its own (``rank-R.slot-{0,1}.bin``) and two of its
source's (``held-S.slot-{0,1}.bin``) in its host folder, each created once (``posix_fallocate``:
a full tmpfs is an ``ENOSPC`` here, never a SIGBUS in a copy) and kept mapped
(``torch.from_file(shared=True)``: the pages outlive a SIGKILL). A snapshot goes into the slot
that does not hold the newest committed step (``target``), whose manifest is unlinked first; its
manifest is written last, so a payload without one is half-written and never read. ``keep``
makes a step the committed one and unlinks every other manifest.

Trust: the host folder is a private 0700 folder of this user (``files.ensure_private_dir``); a
payload is mapped only once it is a regular file of this user of exactly the manifest's size; a
manifest, read from a file or received from a partner, is used only when it is of this run
(``check``), and partner bytes are verified chunk by chunk against the manifest received with
them. Files are deleted only by slot name, and only this rank's own and its source's held
files: at the first snapshot of a start (``forget_earlier``), the manifests it did not restore
(an earlier start's snapshots are never mixed with this one's) and the payloads of another run
(a manifest naming another run id); then and at the run's end, the temp files of those
manifests that a killed write left (``io.stray_temps``: mkstemp's exact names, regular files).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from goodput.checkpoint.groups import lazy_gloo_group
from goodput.checkpoint.snapshot import wire
from goodput.checkpoint.snapshot.files import (
    SLOTS,
    Kind,
    ensure_private_dir,
    host_folder,
    manifest_name,
    memory_root,
    own_file,
    payload_name,
    read_manifest,
    run_key,
)
from goodput.checkpoint.snapshot.format import (
    CHUNK_BYTES,
    FIX,
    Manifest,
    first_bad_chunk,
    parse_manifest,
)
from goodput.checkpoint.snapshot.pairing import Pairing, hosts_shape
from goodput.errors import GoodputError
from goodput.io import stray_temps, write_bytes

# A partner that died mid-transfer ends the wait after this (the idle watchdog may come first).
EXCHANGE_TIMEOUT = timedelta(minutes=5)
MAX_DIGEST_WORKERS = 8


class Slots:
    """This rank's slot files of one run and the store's gloo group (see the module docstring).
    Built by every rank at the same moment: it creates the group (the snapshot exchange runs on
    a background thread, and two threads' collectives on one group hang)."""

    # Hashed and sent in chunks of this; tests shrink it to cover many chunks with a tiny state.
    chunk_bytes: int = CHUNK_BYTES

    def __init__(
        self,
        memory_dir: str | None,
        *,
        root: Path,
        run_id: str,
        config_digest: str,
        hosts: Sequence[str],
        rank: int,
    ) -> None:
        self.run_id, self.config_digest = run_id, config_digest
        self.hosts, self.rank, self.world_size = list(hosts), rank, len(hosts)
        self.pairing = Pairing.from_hosts(self.hosts, rank)
        self.shape = hosts_shape(self.hosts)
        self.run_key = run_key(Path(root))
        # Collective. Connected on first use (``groups.lazy_gloo_group``): the pair exchange
        # reaches this rank's holder and source, the store's collectives (all-gathers) its ring
        # neighbours — at most 4 peers at any W. Pair groups would hold no fewer sockets, and
        # making them takes every rank through one ``new_group`` a pair.
        self.group = lazy_gloo_group(EXCHANGE_TIMEOUT)
        ranks_here = self.hosts.count(self.hosts[rank])
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.workers = max(1, min(MAX_DIGEST_WORKERS, cpus // ranks_here))
        error: GoodputError | None = None
        try:
            folder = host_folder(memory_root(memory_dir), self.run_key, self.hosts[rank])
            self.folder = ensure_private_dir(folder)
        except GoodputError as exc:
            error = exc
        wire.raise_anywhere(error, self.group)
        self.maps: dict[tuple[Kind, int], torch.Tensor] = {}  # mapped slot files, kept
        self.committed: dict[Kind, int | None] = {"own": None, "held": None}
        self.committed_step: int | None = None

    def target(self, kind: Kind) -> int:
        """The slot a new snapshot of ``kind`` goes to: the one not holding the committed step."""
        return other_slot(self.committed[kind])

    def keep(self, step: int, own_slot: int, held_slot: int | None) -> None:
        """``step`` in ``own_slot`` (and ``held_slot`` of the source's, None: none) is the
        committed one; every other manifest of this rank's goes."""
        self.committed = {"own": own_slot, "held": held_slot}
        self.committed_step = step
        self.unlink(self.folder / manifest_name("own", self.rank, other_slot(own_slot)))
        if self.pairing.source is not None:
            for slot in range(SLOTS):
                if slot != held_slot:
                    self.unlink(self.folder / manifest_name("held", self.pairing.source, slot))

    # --- payloads -------------------------------------------------------------------------

    def mapped(self, kind: Kind, owner: int, slot: int, num_bytes: int) -> torch.Tensor:
        """The slot's payload mapped, ``num_bytes`` long: kept from before, or (re)created and
        its pages reserved (``ENOSPC`` now rather than SIGBUS in a copy)."""
        mapped = self.maps.get((kind, slot))
        if mapped is not None and mapped.numel() == num_bytes:
            return mapped
        path = self.folder / payload_name(kind, owner, slot)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            if os.fstat(fd).st_size != num_bytes:
                os.ftruncate(fd, num_bytes)
            os.posix_fallocate(fd, 0, num_bytes)
        finally:
            os.close(fd)
        mapped = torch.from_file(str(path), shared=True, size=num_bytes, dtype=torch.uint8)
        self.maps[(kind, slot)] = mapped
        return mapped

    def mapped_existing(self, kind: Kind, owner: int, slot: int, num_bytes: int) -> torch.Tensor:
        """An existing payload mapped, once it is checked (mapping never grows a file here)."""
        self.payload_file(kind, owner, slot, num_bytes)
        return self.mapped(kind, owner, slot, num_bytes)

    def payload_file(self, kind: Kind, owner: int, slot: int, num_bytes: int) -> Path:
        """The slot's payload file, if it is a regular file of this user of ``num_bytes``."""
        path = self.folder / payload_name(kind, owner, slot)
        info = own_file(path)
        if info.st_size != num_bytes:
            raise refused(path, f"is {info.st_size} bytes, its manifest says {num_bytes}")
        return path

    def check(self, manifest: Manifest, kind: Kind, owner: int, where: str) -> Manifest:
        """``manifest`` if it belongs to this run, ``owner`` and this world; else GoodputError."""
        wanted: list[tuple[str, object, object]] = [
            ("run id", manifest.run_id, self.run_id),
            ("run key (checkpoint folder)", manifest.run_key, self.run_key),
            ("config digest", manifest.config_digest, self.config_digest),
            ("rank", manifest.rank, owner),
            ("world size", manifest.world_size, self.world_size),
            ("hosts shape", manifest.hosts_shape, self.shape),
        ]
        for name, theirs, ours in wanted:
            if theirs != ours:
                raise refused(where, f"is of another {name} ({theirs}; this run: {ours})")
        return manifest

    def receive(
        self, src: int, tag: int, kind: Kind, owner: int, slot: int, step: int
    ) -> str | None:
        """Receive ``owner``'s snapshot of ``step`` from ``src`` into slot ``slot`` of ``kind``,
        verify it and write its manifest last: None, or why it was not kept."""
        self.unlink(self.folder / manifest_name(kind, owner, slot))
        where = f"rank {src}'s copy of rank {owner}'s memory snapshot of step {step}"
        manifests: list[Manifest] = []

        def accept(data: bytes, num_bytes: int) -> torch.Tensor:
            manifest = self.check(parse_manifest(data, where), kind, owner, where)
            if manifest.step != step:
                raise refused(where, f"is of step {manifest.step}, not {step}")
            if manifest.payload_bytes != num_bytes:
                raise refused(where, f"came with {num_bytes} bytes, not its manifest's")
            manifests.append(manifest)
            return self.mapped(kind, owner, slot, num_bytes)

        received = wire.receive(self.group, src, tag, accept)
        if isinstance(received, str):
            return received
        data, payload = received
        bad = first_bad_chunk(payload_memory(payload), manifests[0], self.workers)
        if bad is not None:
            return f"{where}: chunk {bad} checksum differs"
        write_bytes(self.folder / manifest_name(kind, owner, slot), data)
        return None

    # --- deletion -------------------------------------------------------------------------

    def forget_earlier(self) -> None:
        """Before this start's first snapshot: drop the manifests of this rank's slot files (own,
        and held of its source) that this start did not restore, so no snapshot of an earlier
        start is ever mixed with this one's; a slot of another run (its manifest names another
        run id) loses its payload too. The name and a valid manifest prove goodput wrote them.
        A manifest's temp file left by a rank killed mid-write goes too (``stray_temps``)."""
        self._remove_stray_temps()
        for kind, owner in self._files_of_mine():
            for slot in range(SLOTS):
                if slot == self.committed[kind]:
                    continue
                path = self.folder / manifest_name(kind, owner, slot)
                try:
                    manifest = read_manifest(path)
                except GoodputError:  # none, or not proven ours: left alone
                    continue
                self.unlink(path)
                if (manifest.run_id, manifest.run_key) != (self.run_id, self.run_key):
                    self.unlink(self.folder / payload_name(kind, owner, slot))
                    self.maps.pop((kind, slot), None)

    def _files_of_mine(self) -> list[tuple[Kind, int]]:
        """(kind, owner) of the slot files this rank writes: its own, its source's held."""
        mine: list[tuple[Kind, int]] = [("own", self.rank)]
        if self.pairing.source is not None:
            mine.append(("held", self.pairing.source))
        return mine

    def _remove_stray_temps(self) -> None:
        """The temp files of this rank's manifests that a killed write left (a SIGKILL between
        the temp write and its rename): host memory, held until removed."""
        for kind, owner in self._files_of_mine():
            for slot in range(SLOTS):
                for path in stray_temps(self.folder / manifest_name(kind, owner, slot)):
                    self.unlink(path)

    def unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def close(self, *, finished: bool) -> None:
        """``finished`` (the run's last step is done): remove this rank's files; else keep them
        for the restart. Then unmap them and leave the group."""
        if finished:
            self._remove_stray_temps()
            for kind, owner in self._files_of_mine():
                for slot in range(SLOTS):
                    self.unlink(self.folder / manifest_name(kind, owner, slot))
                    self.unlink(self.folder / payload_name(kind, owner, slot))
            for folder in (self.folder, self.folder.parent):
                with contextlib.suppress(OSError):  # the host's last rank leaves no empty folder
                    folder.rmdir()
        self.maps.clear()
        dist.destroy_process_group(self.group)


def payload_memory(payload: torch.Tensor) -> memoryview:
    """A mapped payload's bytes, for hashing."""
    return payload.numpy().data


def other_slot(slot: int | None) -> int:
    """The slot a new snapshot goes to beside ``slot`` (None: none committed, slot 0)."""
    return 0 if slot is None else 1 - slot


def refused(where: object, what: str) -> GoodputError:
    return GoodputError(where, f"memory snapshot {what}", FIX)
