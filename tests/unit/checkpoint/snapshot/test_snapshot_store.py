"""The in-memory checkpoint store (``checkpoint.snapshot``: store, slots, restore) on real gloo
ranks (spawned processes), hosts emulated by name: a snapshot taken, committed and restored by a
fresh store (a restart) is bit for bit the state that was taken — model, optimizer, train
state, RNG — from the rank's own copy, or from its partner's when its host was replaced (a new
host name: an empty folder) or its own copy is damaged; with no intact copy every rank refuses
alike. Half-written, foreign, truncated and hostile files are never loaded.

Each spawn runs several restarts in one process group (a restart is a new store over the same
folder; its mappings of the old one are gone), to keep the spawns few."""

import contextlib
import hashlib
import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.parts import gather
from goodput.checkpoint.snapshot.files import (
    host_folder,
    manifest_name,
    memory_root,
    payload_name,
    read_manifest,
    run_key,
)
from goodput.checkpoint.snapshot.format import flatten_state
from goodput.checkpoint.snapshot.restore import SnapshotRefused
from goodput.checkpoint.snapshot.store import SnapshotStore
from goodput.checkpoint.snapshot.wire import TAG_SNAPSHOT
from goodput.checkpoint.state import CheckpointContents
from goodput.errors import GoodputError
from goodput.testing.dist import run_distributed
from goodput.testing.snapshots import LoaderPosition

RUN_ID = "0123456789abcdef"
OTHER_RUN = "fedcba9876543210"
DIGEST = hashlib.sha256(b"config").hexdigest()
CPU = torch.device("cpu")


class FailingWrite:
    """Stands in for a FaultPlan whose hook fails the write (the real plan's snapshot fault
    SIGKILLs the rank, which a spawned test rank cannot survive): a full /dev/shm."""

    def on_snapshot_write(self, step: int, rank: int) -> None:
        raise OSError(28, "No space left on device")


def contents_of(seed: int) -> CheckpointContents:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return CheckpointContents(
        parts=[model], optimizers=[optimizer], states={"loader": LoaderPosition()}
    )


def train(contents: CheckpointContents, steps: int) -> None:
    """Steps on rank-dependent data: every rank's state differs."""
    model, optimizer = contents.parts[0], contents.optimizers[0]
    for _ in range(steps):
        data = torch.randn(2, 4) + dist.get_rank()
        model(data).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        contents.states["loader"].consumed += 2


def state_of(contents: CheckpointContents) -> dict[str, torch.Tensor]:
    model, optim, _ = gather(contents.parts, contents.optimizers)
    return {k: v.clone() for k, v in flatten_state({"model": model, "optim": optim}).items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def store_of(tmp: str, hosts: list[str], run_id: str = RUN_ID) -> SnapshotStore:
    cfg = CheckpointConfig(memory_interval_steps=1, memory_dir=tmp)
    store = SnapshotStore(
        cfg,
        root=Path(tmp) / "ckpt",
        run_id=run_id,
        config_digest=DIGEST,
        hosts=hosts,
        rank=dist.get_rank(),
        device=CPU,
        faults=None,
    )
    store.slots.chunk_bytes = 128  # a 512-byte payload in 4 chunks: transfers and checks per chunk
    return store


def folder_of(tmp: str, host: str) -> Path:
    return host_folder(memory_root(tmp), run_key(Path(tmp) / "ckpt"), host)


def snapshot(store: SnapshotStore, contents: CheckpointContents, step: int, staged=None) -> bool:
    """take + settle + commit, as the trainer's step hooks do (the vote: every rank's ok)."""
    store.take(step, contents, staged)
    ok, _ = store.settle()
    flags = torch.tensor([0 if ok else 1])
    dist.all_reduce(flags)
    store.commit(flags.item() == 0)
    return ok


def restart(tmp: str, hosts: list[str], **kwargs) -> tuple[object, str, CheckpointContents]:
    """A fresh store and freshly built contents: (the Restored or the refusal line or None,
    what this rank printed, the contents)."""
    out = io.StringIO()
    contents = contents_of(seed=1000 + dist.get_rank())
    with contextlib.redirect_stdout(out):
        store = store_of(tmp, hosts, **kwargs)
        step = store.choose(None, 10)
        outcome: object = None
        if step is not None:
            try:
                outcome = store.restore(step, contents)
            except SnapshotRefused as refused:
                outcome = refused.line
        store.close(finished=False)
    dist.barrier()
    return outcome, out.getvalue(), contents


def file_of(tmp: str, host: str, kind: str, owner: int, suffix: str) -> Path:
    """The slot file of ``kind``/``owner`` whose manifest exists (the committed one)."""
    folder = folder_of(tmp, host)
    for slot in range(2):
        if (folder / manifest_name(kind, owner, slot)).exists():
            name = manifest_name if suffix == "json" else payload_name
            return folder / name(kind, owner, slot)
    raise AssertionError(f"no {kind} manifest of rank {owner} in {folder}")


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def two_hosts(rank: int, world_size: int, tmp: str) -> dict:
    results: dict = {}
    contents = contents_of(seed=rank)
    store = store_of(tmp, ["n1", "n2"])
    results["describe"] = store.describe()
    train(contents, 1)
    results["ok1"] = snapshot(store, contents, 1)
    train(contents, 1)
    expected = state_of(contents)
    rng = torch.get_rng_state()
    # The async save's staged copy (its host copy of the step's state), copied in the background.
    model, optim, _ = gather(contents.parts, contents.optimizers)
    staged = {
        "model": {k: v.clone() for k, v in model.items()},
        "optim": {name: {k: v.clone() for k, v in entry.items()} for name, entry in optim.items()},
    }
    with torch.no_grad():  # the live state moves on: the snapshot is the staged copy's
        contents.parts[0].weight.add_(1.0)
    results["ok2"] = snapshot(store, contents, 2, staged)
    store.close(finished=False)
    dist.barrier()
    # Only the committed step's manifests stay: one own, one held per rank.
    folder = folder_of(tmp, f"n{rank + 1}")
    results["manifests"] = sorted(p.name for p in folder.glob("*.json"))

    def check(name: str, hosts: list[str], **kwargs) -> None:
        outcome, printed, restored = restart(tmp, hosts, **kwargs)
        results[name] = outcome
        results[f"{name}_printed"] = printed
        results[f"{name}_bitwise"] = same(state_of(restored), expected) and torch.equal(
            torch.get_rng_state(), rng
        )
        results[f"{name}_consumed"] = restored.states["loader"].consumed

    check("own", ["n1", "n2"])
    check("partner", ["n1", "n3"])  # n2 replaced by n3: rank 1's memory is gone
    # Re-replicated: rank 1 (on n3) holds rank 0's copy again, so n1 may go next.
    results["rereplicated"] = (folder_of(tmp, "n3") / manifest_name("held", 0, 0)).exists() or (
        folder_of(tmp, "n3") / manifest_name("held", 0, 1)
    ).exists()
    if rank == 0:
        flip_byte(file_of(tmp, "n1", "own", 0, "bin"), offset=300)
    dist.barrier()
    check("damaged", ["n1", "n2"])
    if rank == 0:
        flip_byte(file_of(tmp, "n1", "own", 0, "bin"), offset=300)
        flip_byte(file_of(tmp, "n2", "held", 0, "bin"), offset=5)
    dist.barrier()
    check("both_damaged", ["n1", "n2"])
    return results


@pytest.mark.timeout(180)
def test_snapshots_restore_bitwise_from_own_or_partner_copies(tmp_path):
    results = run_distributed(two_hosts, 2, str(tmp_path), timeout_s=150)
    for rank, result in enumerate(results):
        assert result["ok1"] and result["ok2"]
        assert "partner copy on the next host" in result["describe"]
        assert result["manifests"] == sorted(
            [f"rank-0000{rank}.slot-1.json", f"held-0000{1 - rank}.slot-1.json"]
        )
        own = result["own"]
        assert (own.step, own.from_partner, own.source) == (2, 0, "snapshot")
        assert result["own_bitwise"] and result["own_consumed"] == 4
        partner = result["partner"]
        assert (partner.step, partner.from_partner) == (2, 1)
        assert partner.source == ("partner" if rank == 1 else "snapshot")
        assert result["partner_bitwise"] and result["partner_consumed"] == 4
        assert result["rereplicated"]
        damaged = result["damaged"]
        assert damaged.source == ("partner" if rank == 0 else "snapshot")
        assert result["damaged_bitwise"]
        both = result["both_damaged"]
        assert both.startswith("warning: refusing memory snapshots of step 2: rank 0 has no intact")
        assert "own: chunk 2 checksum differs; partner: chunk 0 checksum differs" in both
    assert (
        "warning: memory snapshot of step 2 on rank 0 (n1): chunk 2 checksum differs; "
        "reading its partner copy on rank 1 (n2)" in results[0]["damaged_printed"]
    )
    assert "rank(s) 1 from a partner's copy" in results[0]["partner_printed"]


def refusals(rank: int, world_size: int, tmp: str) -> dict:
    results: dict = {}
    contents = contents_of(seed=rank)
    store = store_of(tmp, ["n1", "n2"])
    train(contents, 1)
    snapshot(store, contents, 1)
    train(contents, 1)
    # Step 2 fails on rank 1 (its write raises): rank 1 still takes part in the exchange (a
    # failure header), rank 0 learns its partner copy is missing, the vote keeps step 1.
    store.faults = FailingWrite() if rank == 1 else None  # type: ignore[assignment]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results["failed_ok"] = snapshot(store, contents, 2)
    results["failed_printed"] = printed.getvalue()
    store.faults = None
    train(contents, 1)
    # Step 3 half-written: taken, never committed, and killed before its manifests (removed
    # here: the rank's own, and its holder's copy that would stand in for it).
    store.take(3, contents)
    store.settle()
    store.close(finished=False)
    dist.barrier()
    if rank == 1:
        (folder_of(tmp, "n2") / manifest_name("own", 1, 1)).unlink()
        (folder_of(tmp, "n1") / manifest_name("held", 1, 1)).unlink()
    dist.barrier()
    results["half_written"] = restart(tmp, ["n1", "n2"])[0]
    # Truncated: rank 0's own payload is refused by its size, never mapped (a read past the end
    # of a mapping is a SIGBUS); its partner's copy stands in.
    if rank == 0:
        path = file_of(tmp, "n1", "own", 0, "bin")
        os.truncate(path, path.stat().st_size // 2)
    dist.barrier()
    results["truncated"], results["truncated_printed"], _ = restart(tmp, ["n1", "n2"])
    # Another run's snapshots (resume = never: a new run id) are refused, and removed at the
    # first snapshot of the new run.
    outcome, printed, contents = restart(tmp, ["n1", "n2"], run_id=OTHER_RUN)
    results["foreign"], results["foreign_printed"] = outcome, printed
    store = store_of(tmp, ["n1", "n2"], run_id=OTHER_RUN)
    snapshot(store, contents, 1)
    store.close(finished=False)
    folder = folder_of(tmp, f"n{rank + 1}")
    results["run_ids"] = sorted({read_manifest(p).run_id for p in folder.glob("*.json")})
    dist.barrier()
    results["partner_bytes"] = hostile_partner(tmp, rank)
    # Hostile folders: a host folder that is a symbolic link, or not a folder at all, refuses
    # the store on every rank (the error of the rank that saw it, named on the others).
    errors = []
    for host, make in (("evil", "link"), ("plain", "file")):
        if rank == 0:
            path = folder_of(tmp, host)
            if make == "link":
                os.symlink(tmp, path)
            else:
                path.write_bytes(b"not a folder")
        dist.barrier()
        try:
            store_of(tmp, [host, "n2"])
        except GoodputError as error:
            errors.append(error.what)
    results["hostile"] = errors
    # A clean finish leaves nothing behind.
    store = store_of(tmp, ["n1", "n2"], run_id=OTHER_RUN)
    store.close(finished=True)
    dist.barrier()
    results["left"] = [p.name for host in ("n1", "n2") for p in folder_of(tmp, host).glob("*")]
    return results


@pytest.mark.timeout(180)
def test_half_written_truncated_foreign_and_hostile_snapshots_are_never_loaded(tmp_path):
    results = run_distributed(refusals, 2, str(tmp_path), timeout_s=150)
    for rank, result in enumerate(results):
        assert not result["failed_ok"]
        assert result["half_written"].step == 1
        assert result["truncated"].step == 1
        assert result["truncated"].source == ("partner" if rank == 0 else "snapshot")
        assert result["foreign"] is None
        assert "is of another run id" in result["foreign_printed"]
        assert result["run_ids"] == [OTHER_RUN]
        link, plain = result["hostile"]
        assert "symbolic link" in link and "not a folder" in plain
        if rank == 1:
            assert link.startswith("on rank 0: ")
        assert result["left"] == []
    assert "bytes, its manifest says" in results[0]["truncated_printed"]
    header, _, not_json, _, tampered, _, true_copy, _ = results[0]["partner_bytes"]
    assert "sent a header [1, 512, 1099511627776, 128] goodput does not send" in header
    assert "memory snapshot manifest is not valid JSON" in not_json
    assert tampered.endswith("chunk 1 checksum differs")
    assert true_copy is None
    assert results[0]["partner_bytes"][1::2] == [None, None, None, "kept"]  # the last one only
    assert results[1]["failed_printed"] == (
        "warning: memory snapshot of step 2 failed on rank 1: No space left on device; "
        "the snapshot of step 1 stays\n"
    )
    assert results[0]["failed_printed"] == (
        "warning: memory snapshot of step 2 failed on rank 0: rank 1 sent no snapshot (its own "
        "failed); the snapshot of step 1 stays\n"
    )


def hostile_partner(tmp: str, rank: int) -> list[str | None]:
    """Rank 1 sends rank 0 what goodput never sends — a header out of bounds, a manifest that is
    not JSON, a payload that does not match its manifest — then a true copy; rank 0's receive
    refuses the three (reading every announced byte, so the next message still lines up) and
    keeps only the last."""
    store = store_of(tmp, ["n1", "n2"], run_id=OTHER_RUN)
    outcomes: list[str | None] = []
    if rank == 1:
        manifest = (folder_of(tmp, "n2") / manifest_name("own", 1, 0)).read_bytes()
        payload = torch.frombuffer(
            bytearray((folder_of(tmp, "n2") / payload_name("own", 1, 0)).read_bytes()),
            dtype=torch.uint8,
        )
        tampered = payload.clone()
        tampered[200] ^= 1
        messages = [
            [torch.tensor([1, 512, 2**40, 128])],
            [
                torch.tensor([1, 512, 9, 128]),
                torch.frombuffer(bytearray(b"not json!"), dtype=torch.uint8),
            ]
            + list(payload.split(128)),
            [
                torch.tensor([1, 512, len(manifest), 128]),
                torch.frombuffer(bytearray(manifest), dtype=torch.uint8),
            ]
            + list(tampered.split(128)),
            [
                torch.tensor([1, 512, len(manifest), 128]),
                torch.frombuffer(bytearray(manifest), dtype=torch.uint8),
            ]
            + list(payload.split(128)),
        ]
        for pieces in messages:
            for piece in pieces:
                dist.send(piece.contiguous(), 0, group=store.slots.group, tag=TAG_SNAPSHOT)
    else:
        for _ in range(4):
            outcomes.append(store.slots.receive(1, TAG_SNAPSHOT, "held", 1, 1, step=1))
            kept = folder_of(tmp, "n1") / manifest_name("held", 1, 1)
            outcomes.append("kept" if kept.exists() else None)
    store.close(finished=False)
    dist.barrier()
    return outcomes


def four_ranks(rank: int, world_size: int, tmp: str) -> dict:
    contents = contents_of(seed=rank)
    store = store_of(tmp, ["n1", "n1", "n2", "n2"])
    train(contents, 2)
    expected = state_of(contents)
    ok = snapshot(store, contents, 3)
    store.close(finished=False)
    dist.barrier()
    outcome, _, restored = restart(tmp, ["n1", "n1", "n3", "n3"])
    return {"ok": ok, "restored": outcome, "bitwise": same(state_of(restored), expected)}


@pytest.mark.timeout(180)
def test_four_ranks_on_two_hosts_come_back_after_a_host_is_replaced(tmp_path):
    results = run_distributed(four_ranks, 4, str(tmp_path), timeout_s=150)
    for rank, result in enumerate(results):
        assert result["ok"] and result["bitwise"]
        restored = result["restored"]
        assert (restored.step, restored.from_partner) == (3, 2)
        assert restored.source == ("partner" if rank >= 2 else "snapshot")


class RefusingLoader(LoaderPosition):
    """A loader whose data changed since the snapshot: it refuses the saved position."""

    def load_state_dict(self, state) -> None:
        raise ValueError("the data fingerprint differs (test)")


def load_failure(rank: int, world_size: int, tmp: str) -> dict:
    results: dict = {}
    contents = contents_of(seed=rank)
    store = store_of(tmp, ["n1", "n2"])
    for step in (1, 2):  # step 2 in slot 1, committed
        train(contents, 1)
        snapshot(store, contents, step)
    store.close(finished=False)
    dist.barrier()
    # Verified intact on both hosts, but rank 1's train state is refused: nothing can be
    # undone on rank 0 by then, so the restore is an error on every rank, not a fallback.
    fresh = contents_of(seed=1000 + rank)
    if rank == 1:
        fresh.states["loader"] = RefusingLoader()  # type: ignore[index]
    store = store_of(tmp, ["n1", "n2"])
    step = store.choose(None, 10)
    assert step == 2
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            store.restore(step, fresh)
    except GoodputError as error:
        results["error"] = str(error)
    # The next start restores nothing (resumes from disk, say): its first snapshot (into slot
    # 0) drops every manifest an earlier start left (step 2's in slot 1), so no earlier
    # snapshot is ever mixed with this start's.
    store.take(3, contents_of(seed=rank))
    store.settle()
    folder = folder_of(tmp, f"n{rank + 1}")
    results["steps"] = sorted(read_manifest(p).step for p in folder.glob("*.json"))
    store.close(finished=False)
    return results


@pytest.mark.timeout(180)
def test_a_verified_snapshot_whose_train_state_is_refused_stops_every_rank(tmp_path):
    results = run_distributed(load_failure, 2, str(tmp_path), timeout_s=150)
    manifest = folder_of(str(tmp_path), "n2") / manifest_name("own", 1, 1)
    assert results[1]["error"] == (
        f"{manifest}: memory snapshot not loaded: {manifest}: damaged: the data fingerprint "
        "differs (test); restart with checkpoint.memory_interval_steps=0 to resume from the "
        "disk checkpoint, or undo what changed"
    )
    assert results[0]["error"].startswith(f"{manifest}: on rank 1: memory snapshot not loaded")
    for result in results:
        assert result["steps"] == [3, 3], result  # own and held of step 3; step 2's dropped


def killed_writes(rank: int, world_size: int, tmp: str) -> dict:
    """Manifest temp files a SIGKILL left (between the temp write and its rename) in each host
    folder, and lookalikes that are not this rank's to delete."""
    folder = folder_of(tmp, f"n{rank + 1}")
    store = store_of(tmp, ["n1", "n2"])  # rank 0 holds rank 1's copies and the reverse
    source = 1 - rank

    def plant() -> tuple[list[Path], list[Path]]:
        mine = [
            folder / f".{manifest_name('own', rank, 0)}.k1ll_d{rank}0.tmp",
            folder / f".{manifest_name('held', source, 1)}.k1ll_d{rank}1.tmp",
        ]
        others = [
            folder / f".{manifest_name('own', 7, 0)}.k1ll_d{rank}2.tmp",  # no rank 7 here
            folder / f".{payload_name('own', rank, 0)}.k1ll_d{rank}3.tmp",  # never written so
            folder / f".{manifest_name('own', rank, 1)}.k1ll_d{rank}44.tmp",  # not mkstemp's
        ]
        for path in mine + others:
            path.touch()
        return mine, others

    mine, others = plant()
    contents = contents_of(seed=rank)
    train(contents, 1)
    snapshot(store, contents, 1)  # a start's first snapshot: what an earlier one left goes
    results = {"first": [p.exists() for p in mine], "kept": [p.exists() for p in others]}
    mine, _ = plant()
    store.close(finished=True)  # the run's end: this rank's files go, strays too
    results["finished"] = [p.exists() for p in mine]
    results["left"] = sorted(p.name for p in folder.iterdir())
    results["others"] = sorted(p.name for p in others)
    return results


@pytest.mark.timeout(180)
def test_temp_files_of_killed_manifest_writes_are_removed_and_nothing_else(tmp_path):
    for result in run_distributed(killed_writes, 2, str(tmp_path), timeout_s=150):
        assert result["first"] == [False, False] and result["kept"] == [True, True, True]
        assert result["finished"] == [False, False]
        assert result["left"] == result["others"]
