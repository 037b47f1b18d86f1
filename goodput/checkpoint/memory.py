"""Memory snapshots: each rank's checkpoint state in host memory that outlives the process, with a
copy on a rank of the next host, and the restart that loads the newest step every rank has.

One ``SnapshotStore`` per rank, built by every rank at the same moment (it creates its own gloo
group: the snapshot exchange runs on a background thread, and two threads' collectives on one
group hang). Files and their format are ``memory_format``'s, the messages between ranks
``memory_wire``'s; this module keeps the slots and decides (one class, past 600 lines: the step
flow and the restart share the slot state — mappings, committed slots, the pending snapshot).

Slots. A rank keeps two payload files of its own (``rank-R.slot-{0,1}.bin``) and two of its
source's (``held-S.slot-{0,1}.bin``) in its host folder, each created once (``posix_fallocate``:
a full tmpfs is an ``ENOSPC`` here, never a SIGBUS in a copy) and kept mapped
(``torch.from_file(shared=True)``: the pages outlive a SIGKILL). A snapshot goes into the slot
that does not hold the newest committed step, whose manifest is unlinked first; its manifest is
written last, so a payload without one is half-written and never read.

Step flow. ``take`` (main thread) copies the state into the target slot (or, with ``staged``,
leaves that copy to the background: the async save's host copy stays untouched until
``settle``) and starts one background thread: the fault hook, chunk SHA-256s, the own manifest,
then the exchange — this rank's payload to its ``holder``, its ``source``'s into the held slot,
verified chunk by chunk against the manifest received with it (parsed as strictly as one read
from disk), the held manifest written last. Every rank with a partner takes part in the
exchange even when its own snapshot failed (it sends a failure header), so no peer waits for
bytes that never come. ``settle`` joins the thread; ``commit(True)`` (every rank's snapshot
complete, by the checkpoint vote) unlinks the older manifests, ``commit(False)`` keeps them.

Restart. ``choose`` scans this rank's own slots and the held slots of its source, keeps the
manifests of this run (run id, run key, config digest, rank, world size, hosts shape, step
between the newest disk checkpoint and the last step), gathers ``[own0, own1, held0, held1]``
from every rank and takes ``newest_complete``. ``restore`` verifies every copy of that step,
fetches the holder's copy for a rank whose own is missing or damaged, re-sends a rank's copy to
a holder that lacks an intact one (so a second loss is covered at once), and loads; every rank
decides from the same gathered verdicts, so a refusal (``SnapshotRefused``) happens on every
rank alike, before anything is loaded, and the run falls back to the disk checkpoint. The load
then goes in a checkpoint's order (train state, tensors, RNG); a failure there stops the run
on every rank, as a checkpoint's would, since some ranks may already hold the snapshot's state.

Trust: the host folder is a private 0700 folder of this user (``ensure_private_dir``); a
payload is mapped only once it is a regular file of this user of exactly the manifest's size;
partner bytes are held to the same manifest rules as files; nothing is unpickled. Files are
deleted only by slot name, and only this rank's own and its source's held files: at the first
``take`` of a start, the manifests it did not restore (an earlier start's snapshots are never
mixed with this one's) and the payloads of another run (a manifest naming another run id); then
and at the run's end, the temp files of those manifests that a killed write left
(``io.stray_temps``: mkstemp's exact names, regular files).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from goodput.checkpoint import memory_wire as wire
from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.memory_format import (
    CHUNK_BYTES,
    FIX,
    SLOTS,
    Kind,
    Manifest,
    Pairing,
    TensorEntry,
    chunk_digests,
    ensure_private_dir,
    first_bad_chunk,
    flatten_state,
    host_folder,
    hosts_shape,
    layout_digest,
    manifest_bytes,
    manifest_name,
    memory_root,
    newest_complete,
    own_file,
    parse_manifest,
    payload_name,
    payload_size,
    read_manifest,
    run_key,
    tensor_table,
    tensor_view,
)
from goodput.checkpoint.parts import gather, load_into
from goodput.checkpoint.state import CheckpointContents, rng_state, set_rng_state
from goodput.errors import GoodputError
from goodput.faults import FaultPlan
from goodput.io import stray_temps, write_bytes
from goodput.progress import print_line

# A partner that died mid-transfer ends the wait after this (the idle watchdog may come first).
EXCHANGE_TIMEOUT = timedelta(minutes=5)
TAG_SNAPSHOT, TAG_FETCH, TAG_REPLICATE = 1, 2, 3  # p2p tags: snapshot, copy back, re-replicate
MAX_DIGEST_WORKERS = 8
# restore's verdict of one copy: intact, absent, of another layout, unreadable; k + 1: chunk k
INTACT, MISSING, LAYOUT, UNREADABLE = 0, -1, -2, -3
# A snapshot verified but not loadable (its train state refused: the data changed, say).
LOAD_FIX = (
    "restart with checkpoint.memory_interval_steps=0 to resume from the disk checkpoint, or "
    "undo what changed"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Restored:
    """A restore's outcome: the step, how many ranks read a partner's copy, the seconds it took,
    and where this rank's state came from (``snapshot``: its own copy, ``partner``)."""

    step: int
    from_partner: int
    seconds: float
    source: str


class SnapshotRefused(Exception):
    """The chosen snapshot set cannot be loaded; raised on every rank alike, ``line`` says why
    (the caller prints it and resumes from the disk checkpoint)."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


@dataclass(slots=True, kw_only=True)
class _Pending:
    """The snapshot whose background write may still run: its step, its target slots, and once
    the thread is joined its outcome (``failure``: None when complete, else the reason)."""

    step: int
    own_slot: int
    held_slot: int | None
    thread: threading.Thread | None = None
    failure: str | None = None


@dataclass(slots=True, kw_only=True)
class _Choice:
    """What ``choose`` found: the step, every rank's steps, and this rank's manifests by slot."""

    step: int
    holders: list[int | None]
    own: dict[int, Manifest] = field(default_factory=dict)
    held: dict[int, Manifest] = field(default_factory=dict)


class SnapshotStore:
    """This rank's memory snapshots of one run (see the module docstring)."""

    # Hashed and sent in chunks of this; tests shrink it to cover many chunks with a tiny state.
    chunk_bytes: int = CHUNK_BYTES

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        root: Path,
        run_id: str,
        config_digest: str,
        hosts: Sequence[str],
        rank: int,
        device: torch.device,
        faults: FaultPlan | None,
    ) -> None:
        self.cfg, self.run_id, self.config_digest = cfg, run_id, config_digest
        self.hosts, self.rank, self.world_size = list(hosts), rank, len(hosts)
        self.device, self.faults = device, faults
        self.pairing = Pairing.from_hosts(self.hosts, rank)
        self.shape = hosts_shape(self.hosts)
        self.run_key = run_key(Path(root))
        self.group = dist.new_group(backend="gloo", timeout=EXCHANGE_TIMEOUT)  # collective
        ranks_here = self.hosts.count(self.hosts[rank])
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.workers = max(1, min(MAX_DIGEST_WORKERS, cpus // ranks_here))
        error: GoodputError | None = None
        try:
            folder = host_folder(memory_root(cfg.memory_dir), self.run_key, self.hosts[rank])
            self.folder = ensure_private_dir(folder)
        except GoodputError as exc:
            error = exc
        wire.raise_anywhere(error, self.group)
        self.maps: dict[tuple[Kind, int], torch.Tensor] = {}  # mapped slot files, kept
        self.committed: dict[Kind, int | None] = {"own": None, "held": None}
        self.committed_step: int | None = None
        self.pending: _Pending | None = None
        self.cleaned = False  # earlier starts' manifests dropped (at the first take)
        self.choice: _Choice | None = None

    def describe(self) -> str:
        """The start line (rank 0 prints it)."""
        k = self.cfg.memory_interval_steps
        every = f"memory snapshots: every {k} step{'s' if k != 1 else ''} in {self.folder}"
        if self.pairing.holder is not None:
            return f"{every}, partner copy on the next host"
        why = "one host" if self.pairing.num_hosts == 1 else "hosts of unequal rank counts"
        return f"{every}; {why}: no partner copy (a lost host falls back to the disk checkpoint)"

    # --- step flow ------------------------------------------------------------------------

    def take(
        self, step: int, contents: CheckpointContents, staged: Mapping[str, Any] | None = None
    ) -> float:
        """Snapshot ``step``: copy the state into a slot (``staged``: the async save's host copy
        of the same state, copied in the background instead) and start the background write.
        Returns the seconds the caller was held."""
        start = time.perf_counter()
        self._drop_pending()
        if not self.cleaned:
            self._forget_earlier()
            self.cleaned = True
        own_slot = _other(self.committed["own"])
        held_slot = _other(self.committed["held"]) if self.pairing.source is not None else None
        pending = _Pending(step=step, own_slot=own_slot, held_slot=held_slot)
        job: _Job | None = None
        try:
            self._unlink(self.folder / manifest_name("own", self.rank, own_slot))
            job = self._prepare(step, contents, staged, own_slot)
        except (OSError, GoodputError, ValueError, RuntimeError) as exc:
            pending.failure = wire.reason(exc)  # the exchange still runs: it sends a failure header
        pending.thread = threading.Thread(
            target=self._background, args=(pending, job), name="goodput-snapshot", daemon=True
        )
        pending.thread.start()
        self.pending = pending
        return time.perf_counter() - start

    def _prepare(
        self,
        step: int,
        contents: CheckpointContents,
        staged: Mapping[str, Any] | None,
        slot: int,
    ) -> _Job:
        """The main thread's share of ``take``: the state's table, the train state and RNG, the
        slot, and the copy unless ``staged`` is usable."""
        model, optim, groups = gather(contents.parts, contents.optimizers)
        flat = flatten_state({"model": model, "optim": optim})
        table = tensor_table(flat)
        # As Checkpointer.save writes train_state.json: a snapshot holds what a checkpoint holds.
        train_state = {
            "step": step,
            **contents.train_state(),
            "world_size": self.world_size,
            "optimizer_param_groups": groups,
        }
        payload = self._mapped("own", self.rank, slot, payload_size(table))
        source = flatten_state(staged) if staged is not None else None
        if source is None or layout_digest(tensor_table(source)) != layout_digest(table):
            _copy_in(payload, table, flat)
            source = None
        return _Job(
            step=step,
            slot=slot,
            payload=payload,
            table=table,
            staged=source,
            train_state=train_state,
            rng=rng_state(self.device),
        )

    def _background(self, pending: _Pending, job: _Job | None) -> None:
        """The snapshot's write and exchange; never raises (its outcome goes to ``pending``)."""
        data: bytes | None = None
        try:
            if job is not None:
                data = self._write_own(job)
        except Exception as exc:  # a thread boundary: the reason rides the next vote
            pending.failure = wire.reason(exc)
        try:
            failure = self._exchange(pending, job.payload if job and data else None, data)
            pending.failure = pending.failure or failure
        except Exception as exc:
            pending.failure = pending.failure or wire.reason(exc)

    def _write_own(self, job: _Job) -> bytes:
        if job.staged is not None:
            _copy_in(job.payload, job.table, job.staged)
        if self.faults is not None:
            self.faults.on_snapshot_write(job.step, self.rank)
        digests = chunk_digests(_bytes(job.payload), self.chunk_bytes, self.workers)
        manifest = self._manifest(job, tuple(digests))
        data = manifest_bytes(manifest)
        write_bytes(self.folder / manifest_name("own", self.rank, job.slot), data)
        return data

    def _manifest(self, job: _Job, chunks: tuple[str, ...]) -> Manifest:
        return Manifest(
            run_id=self.run_id,
            run_key=self.run_key,
            step=job.step,
            rank=self.rank,
            world_size=self.world_size,
            hosts_shape=self.shape,
            config_digest=self.config_digest,
            layout=layout_digest(job.table),
            payload_bytes=payload_size(job.table),
            chunk_bytes=self.chunk_bytes,
            chunks=chunks,
            tensors=job.table,
            train_state=job.train_state,
            rng=job.rng,
        )

    def _exchange(
        self, pending: _Pending, payload: torch.Tensor | None, data: bytes | None
    ) -> str | None:
        """Send this rank's snapshot to its holder, receive its source's: the failure's reason
        or None."""
        holder, source = self.pairing.holder, self.pairing.source
        snapshot = (payload, data) if payload is not None and data is not None else None
        sends = []
        if holder is not None:
            sends = wire.post(self.group, holder, TAG_SNAPSHOT, snapshot, self.chunk_bytes)
        failure = None
        if source is not None:
            assert pending.held_slot is not None
            failure = self._receive(
                source, TAG_SNAPSHOT, "held", source, pending.held_slot, pending.step
            )
        for work in sends:
            work.wait()
        return failure

    def settle(self) -> tuple[bool, float]:
        """Wait for the last snapshot's background write: (it is complete on this rank, the
        seconds waited). (True, 0.0) when none is pending."""
        pending = self.pending
        if pending is None:
            return True, 0.0
        start = time.perf_counter()
        if pending.thread is not None:
            pending.thread.join()
        return pending.failure is None, time.perf_counter() - start

    def commit(self, everywhere_ok: bool) -> None:
        """After the vote: every rank's last snapshot is complete (``everywhere_ok``), so it
        becomes the committed one and the older manifests go; else the older stay, and a rank
        whose own failed says why."""
        pending = self.pending
        if pending is None:
            return
        ok, _ = self.settle()
        self.pending = None
        if everywhere_ok and ok:
            targets: list[tuple[Kind, int, int | None]] = [("own", self.rank, pending.own_slot)]
            if self.pairing.source is not None:
                targets.append(("held", self.pairing.source, pending.held_slot))
            for kind, owner, slot in targets:
                assert slot is not None
                self._unlink(self.folder / manifest_name(kind, owner, _other(slot)))
                self.committed[kind] = slot
            self.committed_step = pending.step
        elif not ok:
            stays = (
                f"the snapshot of step {self.committed_step} stays"
                if self.committed_step is not None
                else "no earlier snapshot to keep"
            )
            print_line(
                f"warning: memory snapshot of step {pending.step} failed on rank {self.rank}: "
                f"{pending.failure}; {stays}"
            )

    def _drop_pending(self) -> None:
        """A snapshot never committed (no vote came between): wait for it, keep the older."""
        if self.pending is not None:
            self.settle()
            self.pending = None

    # --- transfers ------------------------------------------------------------------------

    def _receive(
        self, src: int, tag: int, kind: Kind, owner: int, slot: int, step: int
    ) -> str | None:
        """Receive ``owner``'s snapshot of ``step`` from ``src`` into slot ``slot`` of ``kind``,
        verify it and write its manifest last: None, or why it was not kept."""
        self._unlink(self.folder / manifest_name(kind, owner, slot))
        where = f"rank {src}'s copy of rank {owner}'s memory snapshot of step {step}"
        manifests: list[Manifest] = []

        def accept(data: bytes, num_bytes: int) -> torch.Tensor:
            manifest = self._check(parse_manifest(data, where), kind, owner, where)
            if manifest.step != step:
                raise _refused(where, f"is of step {manifest.step}, not {step}")
            if manifest.payload_bytes != num_bytes:
                raise _refused(where, f"came with {num_bytes} bytes, not its manifest's")
            manifests.append(manifest)
            return self._mapped(kind, owner, slot, num_bytes)

        received = wire.receive(self.group, src, tag, accept)
        if isinstance(received, str):
            return received
        data, payload = received
        bad = first_bad_chunk(_bytes(payload), manifests[0], self.workers)
        if bad is not None:
            return f"{where}: chunk {bad} checksum differs"
        write_bytes(self.folder / manifest_name(kind, owner, slot), data)
        return None

    # --- restart --------------------------------------------------------------------------

    def choose(self, newest_disk_step: int | None, last_step: int) -> int | None:
        """Collective: the newest step every rank can load from memory (its own copy or its
        holder's), not older than ``newest_disk_step`` nor past ``last_step``; None: none."""
        choice = _Choice(
            step=-1,
            holders=[Pairing.from_hosts(self.hosts, r).holder for r in range(self.world_size)],
        )
        refusals: list[str] = []
        low = newest_disk_step if newest_disk_step is not None else 0
        found = [-1] * (2 * SLOTS)
        for slot in range(SLOTS):
            manifest = self._scan("own", self.rank, slot, low, last_step, refusals)
            if manifest is not None:
                choice.own[slot], found[slot] = manifest, manifest.step
            if self.pairing.source is not None:
                manifest = self._scan("held", self.pairing.source, slot, low, last_step, refusals)
                if manifest is not None:
                    choice.held[slot], found[SLOTS + slot] = manifest, manifest.step
        table = wire.all_gather_ints(found, self.group)
        own = [row[:SLOTS] for row in table]
        held = [row[SLOTS:] for row in table]
        step = newest_complete(own, held, choice.holders, at_least=low)
        for line in refusals:
            print_line(f"warning: {line}")
        if self.rank == 0 and any(s >= 0 for row in table for s in row):
            print_line(self._choice_line(step, own, newest_disk_step))
        if step is None:
            return None
        choice.step = step
        self.choice = choice
        return step

    def _choice_line(
        self, step: int | None, own: list[list[int]], newest_disk_step: int | None
    ) -> str:
        disk = "none" if newest_disk_step is None else f"step {newest_disk_step}"
        if step is None:
            return (
                "memory snapshots: no step is held by every rank or its partner at or after "
                f"the newest disk checkpoint ({disk})"
            )
        lacking = [r for r, steps in enumerate(own) if step not in steps]
        partner = f"; rank(s) {_ranks(lacking)} from a partner's copy" if lacking else ""
        return f"memory snapshots: step {step} is held for every rank (disk: {disk}){partner}"

    def _scan(
        self, kind: Kind, owner: int, slot: int, low: int, last_step: int, refusals: list[str]
    ) -> Manifest | None:
        """The manifest of ``slot`` if it names a usable snapshot of this run, with its
        payload; a refusal's reason into ``refusals``; None when there is none."""
        path = self.folder / manifest_name(kind, owner, slot)
        if not os.path.lexists(path):  # none, or half-written (the manifest comes last)
            return None
        try:
            manifest = self._check(read_manifest(path), kind, owner, str(path))
            if not low <= manifest.step <= last_step:
                raise _refused(
                    path,
                    f"holds step {manifest.step}, outside {low}..{last_step} (the newest disk "
                    "checkpoint to the last step)",
                )
            self._payload_file(kind, owner, slot, manifest.payload_bytes)
        except GoodputError as exc:
            refusals.append(f"rank {self.rank}: {exc.where}: {exc.what}; not loaded")
            return None
        return manifest

    def _check(self, manifest: Manifest, kind: Kind, owner: int, where: str) -> Manifest:
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
                raise _refused(where, f"is of another {name} ({theirs}; this run: {ours})")
        return manifest

    def _payload_file(self, kind: Kind, owner: int, slot: int, num_bytes: int) -> Path:
        """The slot's payload file, if it is a regular file of this user of ``num_bytes``."""
        path = self.folder / payload_name(kind, owner, slot)
        info = own_file(path)
        if info.st_size != num_bytes:
            raise _refused(path, f"is {info.st_size} bytes, its manifest says {num_bytes}")
        return path

    def restore(self, step: int, contents: CheckpointContents) -> Restored:
        """Collective: load the snapshot set of ``step`` (``choose``'s answer) into
        ``contents``, fetching partner copies where a rank's own is missing or damaged and
        re-sending copies to holders that lack them. ``SnapshotRefused`` on every rank alike
        when some rank has no intact copy or the layout is not this run's, before anything is
        loaded; a failure once loading began (the train state refused: the data changed, say)
        is a ``GoodputError`` on every rank, as a checkpoint's load failing is."""
        start = time.perf_counter()
        choice = self.choice
        assert choice is not None and choice.step == step, "restore the step choose returned"
        holders, source = choice.holders, self.pairing.source
        model, optim, _ = gather(contents.parts, contents.optimizers)
        layout = layout_digest(tensor_table(flatten_state({"model": model, "optim": optim})))
        own_slot = _slot_of(choice.own, step)
        held_slot = _slot_of(choice.held, step)
        own_code = self._verdict("own", self.rank, own_slot, choice.own, layout)
        held_code = MISSING
        if source is not None:
            held_code = self._verdict("held", source, held_slot, choice.held, None)
        verdicts = wire.all_gather_ints([own_code, held_code], self.group)
        fetch, replicate = self._plan(step, verdicts, holders)
        failure, own_slot, kept = self._mend(
            choice, fetch, replicate, own_slot, held_slot if held_code == INTACT else None
        )
        # Refused while nothing is loaded yet, on every rank alike; past this point a failure
        # is an error, as a checkpoint's load is: some ranks may hold the snapshot's state.
        failures = wire.all_gather_objects(failure, self.group)
        for r, reason in enumerate(failures):
            if reason is not None:
                raise SnapshotRefused(
                    f"warning: refusing memory snapshots of step {step}: rank {r}: {reason}"
                )
        wire.raise_anywhere(self._load(own_slot, contents, layout), self.group)
        self._committed_after_restore(step, own_slot, kept)
        return Restored(
            step=step,
            from_partner=len(fetch),
            seconds=time.perf_counter() - start,
            source="partner" if self.rank in fetch else "snapshot",
        )

    def _mend(
        self,
        choice: _Choice,
        fetch: list[int],
        replicate: list[int],
        own_slot: int | None,
        held_slot: int | None,
    ) -> tuple[str | None, int, int | None]:
        """The copies ``_plan`` asked for: holders send theirs back to the ranks in ``fetch``,
        the ranks in ``replicate`` re-send theirs to their holders. (Why this rank's own copy
        failed to arrive or None, the slot of its own copy, the slot of the partner copy it
        keeps: ``held_slot``, its intact one, unless it received one.)"""
        step, holders, source = choice.step, choice.holders, self.pairing.source
        works: list[dist.Work] = []
        for r in fetch:
            if holders[r] == self.rank:
                slot = _slot_of(choice.held, step)
                assert slot is not None
                works += self._post_slot("held", r, slot, choice.held[slot], TAG_FETCH)
        if self.rank in replicate:
            holder = holders[self.rank]
            assert own_slot is not None and holder is not None
            works += self._post_slot(
                "own", self.rank, own_slot, choice.own[own_slot], TAG_REPLICATE, holder
            )
        failure: str | None = None
        own_slot = own_slot if own_slot is not None else 0
        if self.rank in fetch:
            holder = holders[self.rank]
            assert holder is not None
            failure = self._receive(holder, TAG_FETCH, "own", self.rank, own_slot, step)
        kept = held_slot
        if source is not None and source in replicate:
            slot = _slot_of(choice.held, step)
            slot = slot if slot is not None else 0
            lost = self._receive(source, TAG_REPLICATE, "held", source, slot, step)
            if lost is not None:
                print_line(f"warning: re-replicating rank {source}'s snapshot failed: {lost}")
            else:
                kept = slot
        for work in works:
            work.wait()
        return failure, own_slot, kept

    def _verdict(
        self,
        kind: Kind,
        owner: int,
        slot: int | None,
        manifests: dict[int, Manifest],
        layout: str | None,
    ) -> int:
        """This rank's copy of ``kind`` of step: INTACT, MISSING, LAYOUT, UNREADABLE or the
        first damaged chunk + 1."""
        if slot is None:
            return MISSING
        manifest = manifests[slot]
        if layout is not None and manifest.layout != layout:
            return LAYOUT
        try:
            payload = self._mapped_existing(kind, owner, slot, manifest.payload_bytes)
        except (GoodputError, OSError):
            return UNREADABLE
        bad = first_bad_chunk(_bytes(payload), manifest, self.workers)
        return INTACT if bad is None else bad + 1

    def _plan(
        self, step: int, verdicts: list[list[int]], holders: list[int | None]
    ) -> tuple[list[int], list[int]]:
        """(ranks fetching their holder's copy, ranks re-sending theirs to their holder), the
        same on every rank; ``SnapshotRefused`` when some rank has no intact copy."""
        fetch, replicate = [], []
        for r, (own_code, _) in enumerate(verdicts):
            holder = holders[r]
            held_code = verdicts[holder][1] if holder is not None else MISSING
            if own_code == LAYOUT:
                raise SnapshotRefused(
                    f"warning: refusing memory snapshots of step {step}: rank {r}'s layout is "
                    "not this run's model (the model or its sharding changed)"
                )
            if own_code != INTACT and held_code != INTACT:
                raise SnapshotRefused(
                    f"warning: refusing memory snapshots of step {step}: rank {r} has no intact "
                    f"copy (own: {_describe(own_code)}; partner: {_describe(held_code)})"
                )
            if own_code != INTACT:
                fetch.append(r)
                assert holder is not None
                if own_code != MISSING and self.rank == 0:
                    print_line(
                        f"warning: memory snapshot of step {step} on rank {r} ({self.hosts[r]}): "
                        f"{_describe(own_code)}; reading its partner copy on rank {holder} "
                        f"({self.hosts[holder]})"
                    )
            elif holder is not None and held_code != INTACT:
                replicate.append(r)
        return fetch, replicate

    def _post_slot(
        self,
        kind: Kind,
        owner: int,
        slot: int,
        manifest: Manifest,
        tag: int,
        dst: int | None = None,
    ) -> list[dist.Work]:
        snapshot = (self.maps[(kind, slot)], manifest_bytes(manifest))
        return wire.post(self.group, owner if dst is None else dst, tag, snapshot, self.chunk_bytes)

    def _load(self, slot: int, contents: CheckpointContents, layout: str) -> GoodputError | None:
        """Load this rank's own slot into ``contents`` in a checkpoint's order (the train state
        first: a changed data fingerprint is refused before any tensor is touched, then the
        tensors, then the RNG): None, or the error, naming the manifest."""
        path = self.folder / manifest_name("own", self.rank, slot)
        try:
            manifest = read_manifest(path)
            if manifest.layout != layout:  # checked by the verdicts; rewritten since?
                raise ValueError("its layout is not this run's (the model changed)")
            payload = self.maps[("own", slot)]

            def fill(request: dict[str, Any]) -> None:
                flat = flatten_state(request)
                if list(flat) != [entry.key for entry in manifest.tensors]:
                    raise ValueError("it does not name this run's tensors")
                for entry in manifest.tensors:
                    flat[entry.key].copy_(tensor_view(payload, entry))

            contents.load_train_state(manifest.train_state, path)
            groups = manifest.train_state["optimizer_param_groups"]
            load_into(contents.parts, contents.optimizers, fill, saved_groups=groups, source=path)
            set_rng_state(manifest.rng, self.device, path)
        except Exception as exc:  # any: every rank must reach the outcomes' gather, or all hang
            return GoodputError(path, f"memory snapshot not loaded: {wire.reason(exc)}", LOAD_FIX)
        return None

    def _committed_after_restore(self, step: int, own_slot: int, held_slot: int | None) -> None:
        """The restored step is the committed one; every other manifest goes."""
        self.committed = {"own": own_slot, "held": held_slot}
        self.committed_step = step
        self._unlink(self.folder / manifest_name("own", self.rank, _other(own_slot)))
        if self.pairing.source is not None:
            for slot in range(SLOTS):
                if slot != held_slot:
                    self._unlink(self.folder / manifest_name("held", self.pairing.source, slot))
        self.choice = None

    # --- files ----------------------------------------------------------------------------

    def _mapped(self, kind: Kind, owner: int, slot: int, num_bytes: int) -> torch.Tensor:
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

    def _mapped_existing(self, kind: Kind, owner: int, slot: int, num_bytes: int) -> torch.Tensor:
        """An existing payload mapped, once it is checked (mapping never grows a file here)."""
        self._payload_file(kind, owner, slot, num_bytes)
        return self._mapped(kind, owner, slot, num_bytes)

    def _forget_earlier(self) -> None:
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
                self._unlink(path)
                if (manifest.run_id, manifest.run_key) != (self.run_id, self.run_key):
                    self._unlink(self.folder / payload_name(kind, owner, slot))
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
                    self._unlink(path)

    def _unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def forget_host(self) -> None:
        """Remove this host's snapshot folder: the host-loss fault (its memory is gone)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def close(self, *, finished: bool) -> None:
        """Wait for the background write; ``finished`` (the run's last step is done): remove
        this rank's files; else keep them for the restart."""
        self._drop_pending()
        if finished:
            self._remove_stray_temps()
            for kind, owner in self._files_of_mine():
                for slot in range(SLOTS):
                    self._unlink(self.folder / manifest_name(kind, owner, slot))
                    self._unlink(self.folder / payload_name(kind, owner, slot))
            for folder in (self.folder, self.folder.parent):
                with contextlib.suppress(OSError):  # the host's last rank leaves no empty folder
                    folder.rmdir()
        self.maps.clear()
        dist.destroy_process_group(self.group)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Job:
    """One snapshot's data for the background write."""

    step: int
    slot: int
    payload: torch.Tensor
    table: tuple[TensorEntry, ...]
    staged: dict[str, torch.Tensor] | None  # the async save's host copy, copied in background
    train_state: dict[str, Any]
    rng: dict[str, Any]


def _copy_in(payload: torch.Tensor, table: Sequence[TensorEntry], flat: Mapping[str, Any]) -> None:
    for entry in table:
        tensor_view(payload, entry).copy_(flat[entry.key])


def _bytes(payload: torch.Tensor) -> memoryview:
    return payload.numpy().data


def _other(slot: int | None) -> int:
    """The slot a new snapshot goes to: the one not holding the committed step."""
    return 0 if slot is None else 1 - slot


def _slot_of(manifests: dict[int, Manifest], step: int) -> int | None:
    return next((slot for slot, m in sorted(manifests.items()) if m.step == step), None)


def _describe(code: int) -> str:
    if code == INTACT:
        return "intact"
    names = {MISSING: "missing", LAYOUT: "another layout", UNREADABLE: "unreadable"}
    return names.get(code, f"chunk {code - 1} checksum differs")


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _refused(where: object, what: str) -> GoodputError:
    return GoodputError(where, f"memory snapshot {what}", FIX)
