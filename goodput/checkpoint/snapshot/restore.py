"""The restart from in-memory checkpoints: choosing the newest step every rank has, and restoring
it.

``choose`` scans this rank's own slots and the held slots of its source, keeps the manifests of
this run (run id, run key, config digest, rank, world size, hosts shape, step between the newest
disk checkpoint and the last step), gathers ``[own0, own1, held0, held1]`` from every rank and
takes ``pairing.newest_complete``. ``restore`` verifies every copy of that step, fetches the
holder's copy for a rank whose own is missing or damaged, re-sends a rank's copy to a holder
that lacks an intact one (so a second loss is covered at once), and loads; every rank decides
from the same gathered verdicts, so a refusal (``SnapshotRefused``) happens on every rank alike,
before anything is loaded, and the run falls back to the disk checkpoint. The load then goes in
a checkpoint's order (train state, tensors, RNG); a failure there stops the run on every rank,
as a checkpoint's would, since some ranks may already hold the snapshot's state. Nothing is
unpickled: the manifests and payloads are held to ``slots``'s rules.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from goodput.checkpoint.parts import gather, load_into
from goodput.checkpoint.snapshot import wire
from goodput.checkpoint.snapshot.files import SLOTS, Kind, manifest_name, read_manifest
from goodput.checkpoint.snapshot.format import (
    Manifest,
    first_bad_chunk,
    flatten_state,
    layout_digest,
    manifest_bytes,
    tensor_table,
    tensor_view,
)
from goodput.checkpoint.snapshot.pairing import Pairing, newest_complete
from goodput.checkpoint.snapshot.slots import Slots, payload_memory, refused
from goodput.checkpoint.snapshot.wire import TAG_FETCH, TAG_REPLICATE
from goodput.checkpoint.state import CheckpointContents, set_rng_state
from goodput.errors import GoodputError
from goodput.progress import print_line

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
class _Choice:
    """What ``choose`` found: the step, every rank's steps, and this rank's manifests by slot."""

    step: int
    holders: list[int | None]
    own: dict[int, Manifest] = field(default_factory=dict)
    held: dict[int, Manifest] = field(default_factory=dict)


class Restart:
    """This rank's part in a restart from its slots (see the module docstring): ``choose``, then
    ``restore`` the step it chose."""

    def __init__(self, slots: Slots, device: torch.device) -> None:
        self.slots, self.device = slots, device
        self.choice: _Choice | None = None

    def choose(self, newest_disk_step: int | None, last_step: int) -> int | None:
        """Collective: the newest step every rank can load from memory (its own copy or its
        holder's), not older than ``newest_disk_step`` nor past ``last_step``; None: none."""
        slots = self.slots
        choice = _Choice(
            step=-1,
            holders=[Pairing.from_hosts(slots.hosts, r).holder for r in range(slots.world_size)],
        )
        refusals: list[str] = []
        low = newest_disk_step if newest_disk_step is not None else 0
        found = [-1] * (2 * SLOTS)
        source = slots.pairing.source
        for slot in range(SLOTS):
            manifest = self._scan("own", slots.rank, slot, low, last_step, refusals)
            if manifest is not None:
                choice.own[slot], found[slot] = manifest, manifest.step
            if source is not None:
                manifest = self._scan("held", source, slot, low, last_step, refusals)
                if manifest is not None:
                    choice.held[slot], found[SLOTS + slot] = manifest, manifest.step
        table = wire.all_gather_ints(found, slots.group)
        own = [row[:SLOTS] for row in table]
        held = [row[SLOTS:] for row in table]
        step = newest_complete(own, held, choice.holders, at_least=low)
        for line in refusals:
            print_line(f"warning: {line}")
        if slots.rank == 0 and any(s >= 0 for row in table for s in row):
            print_line(_choice_line(step, own, newest_disk_step))
        if step is None:
            return None
        choice.step = step
        self.choice = choice
        return step

    def _scan(
        self, kind: Kind, owner: int, slot: int, low: int, last_step: int, refusals: list[str]
    ) -> Manifest | None:
        """The manifest of ``slot`` if it names a usable snapshot of this run, with its
        payload; a refusal's reason into ``refusals``; None when there is none."""
        slots = self.slots
        path = slots.folder / manifest_name(kind, owner, slot)
        if not os.path.lexists(path):  # none, or half-written (the manifest comes last)
            return None
        try:
            manifest = slots.check(read_manifest(path), kind, owner, str(path))
            if not low <= manifest.step <= last_step:
                raise refused(
                    path,
                    f"holds step {manifest.step}, outside {low}..{last_step} (the newest disk "
                    "checkpoint to the last step)",
                )
            slots.payload_file(kind, owner, slot, manifest.payload_bytes)
        except GoodputError as exc:
            refusals.append(f"rank {slots.rank}: {exc.where}: {exc.what}; not loaded")
            return None
        return manifest

    def restore(self, step: int, contents: CheckpointContents) -> Restored:
        """Collective: load the snapshot set of ``step`` (``choose``'s answer) into
        ``contents``, fetching partner copies where a rank's own is missing or damaged and
        re-sending copies to holders that lack them. ``SnapshotRefused`` on every rank alike
        when some rank has no intact copy or the layout is not this run's, before anything is
        loaded; a failure once loading began (the train state refused: the data changed, say)
        is a ``GoodputError`` on every rank, as a checkpoint's load failing is."""
        start = time.perf_counter()
        slots, choice = self.slots, self.choice
        assert choice is not None and choice.step == step, "restore the step choose returned"
        holders, source = choice.holders, slots.pairing.source
        model, optim, _ = gather(contents.parts, contents.optimizers)
        layout = layout_digest(tensor_table(flatten_state({"model": model, "optim": optim})))
        own_slot = _slot_of(choice.own, step)
        held_slot = _slot_of(choice.held, step)
        own_code = self._verdict("own", slots.rank, own_slot, choice.own, layout)
        held_code = MISSING
        if source is not None:
            held_code = self._verdict("held", source, held_slot, choice.held, None)
        verdicts = wire.all_gather_ints([own_code, held_code], slots.group)
        fetch, replicate = self._plan(step, verdicts, holders)
        failure, own_slot, kept = self._mend(
            choice, fetch, replicate, own_slot, held_slot if held_code == INTACT else None
        )
        # Refused while nothing is loaded yet, on every rank alike; past this point a failure
        # is an error, as a checkpoint's load is: some ranks may hold the snapshot's state.
        failures = wire.all_gather_objects(failure, slots.group)
        for r, reason in enumerate(failures):
            if reason is not None:
                raise SnapshotRefused(
                    f"warning: refusing memory snapshots of step {step}: rank {r}: {reason}"
                )
        wire.raise_anywhere(self._load(own_slot, contents, layout), slots.group)
        slots.keep(step, own_slot, kept)  # the restored step is the committed one
        self.choice = None
        return Restored(
            step=step,
            from_partner=len(fetch),
            seconds=time.perf_counter() - start,
            source="partner" if slots.rank in fetch else "snapshot",
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
        slots = self.slots
        step, holders, source, rank = choice.step, choice.holders, slots.pairing.source, slots.rank
        works: list[dist.Work] = []
        for r in fetch:
            if holders[r] == rank:
                slot = _slot_of(choice.held, step)
                assert slot is not None
                works += self._post_slot("held", r, slot, choice.held[slot], TAG_FETCH)
        if rank in replicate:
            holder = holders[rank]
            assert own_slot is not None and holder is not None
            works += self._post_slot(
                "own", rank, own_slot, choice.own[own_slot], TAG_REPLICATE, holder
            )
        failure: str | None = None
        own_slot = own_slot if own_slot is not None else 0
        if rank in fetch:
            holder = holders[rank]
            assert holder is not None
            failure = slots.receive(holder, TAG_FETCH, "own", rank, own_slot, step)
        kept = held_slot
        if source is not None and source in replicate:
            slot = _slot_of(choice.held, step)
            slot = slot if slot is not None else 0
            lost = slots.receive(source, TAG_REPLICATE, "held", source, slot, step)
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
            payload = self.slots.mapped_existing(kind, owner, slot, manifest.payload_bytes)
        except (GoodputError, OSError):
            return UNREADABLE
        bad = first_bad_chunk(payload_memory(payload), manifest, self.slots.workers)
        return INTACT if bad is None else bad + 1

    def _plan(
        self, step: int, verdicts: list[list[int]], holders: list[int | None]
    ) -> tuple[list[int], list[int]]:
        """(ranks fetching their holder's copy, ranks re-sending theirs to their holder), the
        same on every rank; ``SnapshotRefused`` when some rank has no intact copy."""
        hosts = self.slots.hosts
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
                if own_code != MISSING and self.slots.rank == 0:
                    print_line(
                        f"warning: memory snapshot of step {step} on rank {r} ({hosts[r]}): "
                        f"{_describe(own_code)}; reading its partner copy on rank {holder} "
                        f"({hosts[holder]})"
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
        slots = self.slots
        snapshot = (slots.maps[(kind, slot)], manifest_bytes(manifest))
        return wire.post(
            slots.group, owner if dst is None else dst, tag, snapshot, slots.chunk_bytes
        )

    def _load(self, slot: int, contents: CheckpointContents, layout: str) -> GoodputError | None:
        """Load this rank's own slot into ``contents`` in a checkpoint's order (the train state
        first: a changed data fingerprint is refused before any tensor is touched, then the
        tensors, then the RNG): None, or the error, naming the manifest."""
        path = self.slots.folder / manifest_name("own", self.slots.rank, slot)
        try:
            manifest = read_manifest(path)
            if manifest.layout != layout:  # checked by the verdicts; rewritten since?
                raise ValueError("its layout is not this run's (the model changed)")
            payload = self.slots.maps[("own", slot)]

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


def _choice_line(step: int | None, own: list[list[int]], newest_disk_step: int | None) -> str:
    """Rank 0's line of what ``choose`` found."""
    disk = "none" if newest_disk_step is None else f"step {newest_disk_step}"
    if step is None:
        return (
            "memory snapshots: no step is held by every rank or its partner at or after "
            f"the newest disk checkpoint ({disk})"
        )
    lacking = [r for r, steps in enumerate(own) if step not in steps]
    partner = f"; rank(s) {_ranks(lacking)} from a partner's copy" if lacking else ""
    return f"memory snapshots: step {step} is held for every rank (disk: {disk}){partner}"


def _slot_of(manifests: dict[int, Manifest], step: int) -> int | None:
    return next((slot for slot, m in sorted(manifests.items()) if m.step == step), None)


def _describe(code: int) -> str:
    if code == INTACT:
        return "intact"
    names = {MISSING: "missing", LAYOUT: "another layout", UNREADABLE: "unreadable"}
    return names.get(code, f"chunk {code - 1} checksum differs")


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))
