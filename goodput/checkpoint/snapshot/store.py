"""Taking in-memory checkpoints: each rank's checkpoint state in host memory that outlives the
process, with a copy on a rank of the next host; ``SnapshotStore`` is the one handle the trainer
holds, for the step flow here and the restart (``restore``).

One ``SnapshotStore`` per rank, built by every rank at the same moment (its ``slots.Slots``
create the store's own gloo group). Where the files are, which slot is committed and what is
deleted when are ``slots``'s; the files' format ``format``'s and ``files``'s, the partner
``pairing``'s, the messages between ranks ``wire``'s.

Step flow. ``take`` (main thread) copies the state into the target slot (or, with ``staged``,
leaves that copy to the background: the async save's host copy stays untouched until
``settle``) and starts one background thread: the fault hook, chunk SHA-256s, the own manifest,
then the exchange — this rank's payload to its ``holder``, its ``source``'s into the held slot,
verified chunk by chunk against the manifest received with it (parsed as strictly as one read
from disk), the held manifest written last. Every rank with a partner takes part in the
exchange even when its own snapshot failed (it sends a failure header), so no peer waits for
bytes that never come. ``settle`` joins the thread; ``commit(True)`` (every rank's snapshot
complete, by the step's vote) unlinks the older manifests, ``commit(False)`` keeps them. The
first ``take`` of a start first drops what an earlier start left (``Slots.forget_earlier``).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.parts import gather
from goodput.checkpoint.snapshot import wire
from goodput.checkpoint.snapshot.files import manifest_name
from goodput.checkpoint.snapshot.format import (
    Manifest,
    TensorEntry,
    chunk_digests,
    flatten_state,
    layout_digest,
    manifest_bytes,
    payload_size,
    tensor_table,
    tensor_view,
)
from goodput.checkpoint.snapshot.restore import Restart, Restored
from goodput.checkpoint.snapshot.slots import Slots, payload_memory
from goodput.checkpoint.snapshot.wire import TAG_SNAPSHOT
from goodput.checkpoint.state import CheckpointContents, rng_state
from goodput.errors import GoodputError
from goodput.faults import FaultPlan
from goodput.io import write_bytes
from goodput.progress import print_line


@dataclass(slots=True, kw_only=True)
class _Pending:
    """The snapshot whose background write may still run: its step, its target slots, and once
    the thread is joined its outcome (``failure``: None when complete, else the reason)."""

    step: int
    own_slot: int
    held_slot: int | None
    thread: threading.Thread | None = None
    failure: str | None = None


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


class SnapshotStore:
    """This rank's in-memory checkpoints of one run (see the module docstring)."""

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
        self.cfg, self.device, self.faults = cfg, device, faults
        self.slots = Slots(
            cfg.memory_dir,
            root=root,
            run_id=run_id,
            config_digest=config_digest,
            hosts=hosts,
            rank=rank,
        )
        self.restart = Restart(self.slots, device)
        self.pending: _Pending | None = None
        self.cleaned = False  # earlier starts' manifests dropped (at the first take)

    @property
    def run_id(self) -> str:
        return self.slots.run_id

    def describe(self) -> str:
        """The start line (rank 0 prints it)."""
        k = self.cfg.memory_interval_steps
        every = f"memory snapshots: every {k} step{'s' if k != 1 else ''} in {self.slots.folder}"
        pairing = self.slots.pairing
        if pairing.holder is not None:
            return f"{every}, partner copy on the next host"
        why = "one host" if pairing.num_hosts == 1 else "hosts of unequal rank counts"
        return f"{every}; {why}: no partner copy (a lost host falls back to the disk checkpoint)"

    # --- the restart ----------------------------------------------------------------------

    def choose(self, newest_disk_step: int | None, last_step: int) -> int | None:
        """Collective: the newest step every rank can load from memory, not older than
        ``newest_disk_step`` nor past ``last_step``; None: none (``Restart.choose``)."""
        return self.restart.choose(newest_disk_step, last_step)

    def restore(self, step: int, contents: CheckpointContents) -> Restored:
        """Collective: load the snapshot set of ``step``, ``choose``'s answer, into ``contents``
        (``Restart.restore``: ``SnapshotRefused`` on every rank alike, before anything is
        loaded, when some rank has no intact copy)."""
        return self.restart.restore(step, contents)

    # --- step flow ------------------------------------------------------------------------

    def take(
        self, step: int, contents: CheckpointContents, staged: Mapping[str, Any] | None = None
    ) -> float:
        """Snapshot ``step``: copy the state into a slot (``staged``: the async save's host copy
        of the same state, copied in the background instead) and start the background write.
        Returns the seconds the caller was held."""
        start = time.perf_counter()
        slots = self.slots
        self._drop_pending()
        if not self.cleaned:
            slots.forget_earlier()
            self.cleaned = True
        own_slot = slots.target("own")
        held_slot = slots.target("held") if slots.pairing.source is not None else None
        pending = _Pending(step=step, own_slot=own_slot, held_slot=held_slot)
        job: _Job | None = None
        try:
            slots.unlink(slots.folder / manifest_name("own", slots.rank, own_slot))
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
            "world_size": self.slots.world_size,
            "optimizer_param_groups": groups,
        }
        payload = self.slots.mapped("own", self.slots.rank, slot, payload_size(table))
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
        slots = self.slots
        if job.staged is not None:
            _copy_in(job.payload, job.table, job.staged)
        if self.faults is not None:
            self.faults.on_snapshot_write(job.step, slots.rank)
        digests = chunk_digests(payload_memory(job.payload), slots.chunk_bytes, slots.workers)
        manifest = self._manifest(job, tuple(digests))
        data = manifest_bytes(manifest)
        write_bytes(slots.folder / manifest_name("own", slots.rank, job.slot), data)
        return data

    def _manifest(self, job: _Job, chunks: tuple[str, ...]) -> Manifest:
        slots = self.slots
        return Manifest(
            run_id=slots.run_id,
            run_key=slots.run_key,
            step=job.step,
            rank=slots.rank,
            world_size=slots.world_size,
            hosts_shape=slots.shape,
            config_digest=slots.config_digest,
            layout=layout_digest(job.table),
            payload_bytes=payload_size(job.table),
            chunk_bytes=slots.chunk_bytes,
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
        slots = self.slots
        holder, source = slots.pairing.holder, slots.pairing.source
        snapshot = (payload, data) if payload is not None and data is not None else None
        sends = []
        if holder is not None:
            sends = wire.post(slots.group, holder, TAG_SNAPSHOT, snapshot, slots.chunk_bytes)
        failure = None
        if source is not None:
            assert pending.held_slot is not None
            failure = slots.receive(
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
            self.slots.keep(pending.step, pending.own_slot, pending.held_slot)
        elif not ok:
            committed = self.slots.committed_step
            stays = (
                f"the snapshot of step {committed} stays"
                if committed is not None
                else "no earlier snapshot to keep"
            )
            print_line(
                f"warning: memory snapshot of step {pending.step} failed on rank "
                f"{self.slots.rank}: {pending.failure}; {stays}"
            )

    def _drop_pending(self) -> None:
        """A snapshot never committed (no vote came between): wait for it, keep the older."""
        if self.pending is not None:
            self.settle()
            self.pending = None

    def forget_host(self) -> None:
        """Remove this host's snapshot folder: the host-loss fault (its memory is gone)."""
        shutil.rmtree(self.slots.folder, ignore_errors=True)

    def close(self, *, finished: bool) -> None:
        """Wait for the background write; ``finished`` (the run's last step is done): remove
        this rank's files; else keep them for the restart."""
        self._drop_pending()
        self.slots.close(finished=finished)


def _copy_in(payload: torch.Tensor, table: Sequence[TensorEntry], flat: Mapping[str, Any]) -> None:
    for entry in table:
        tensor_view(payload, entry).copy_(flat[entry.key])
