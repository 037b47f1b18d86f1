"""The memory-snapshot format (``goodput.checkpoint.memory_format``): tensor tables and payload
views, manifests written and read back strictly, hostile files and folders, names, the pairing
of ranks across hosts and the restart vote (``newest_complete``) against brute force."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from goodput.checkpoint.memory_format import (
    ALIGN,
    MAX_MANIFEST_BYTES,
    SNAPSHOT_FILE,
    Pairing,
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
    write_manifest,
)
from goodput.errors import ExitCode, GoodputError
from goodput.testing.dist import run_distributed
from goodput.testing.snapshots import pack, sample_manifest, sample_state

OTHER_UID = 4242
PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)


def test_flatten_state_names_every_tensor_and_keeps_it_live():
    state = sample_state()
    flat = flatten_state(state)
    assert list(flat) == sorted(flat)
    assert "optim/layers.float32.weight/exp_avg" in flat
    assert len(flat) == len(state["model"]) + len(state["optim"]["layers.float32.weight"])
    flat["optim/layers.float32.weight/step"].fill_(9.0)  # a view: the optimizer's own tensor
    assert state["optim"]["layers.float32.weight"]["step"].item() == 9.0


@pytest.mark.parametrize(
    "state",
    [
        {"model": {"w": torch.zeros(2)}, "optim": {"w": {"step": 3}}},  # a number, not a tensor
        {"model": {"a/b": torch.zeros(2)}},  # a key part with "/": two keys could collide
        {"model": {"": torch.zeros(2)}},
    ],
)
def test_flatten_state_refuses_what_a_payload_cannot_name(state):
    with pytest.raises(ValueError):
        flatten_state(state)


def _flatten_a_dtensor(rank: int, world_size: int) -> tuple[list[int], bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    whole = torch.arange(8.0).reshape(4, 2)
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    flat = flatten_state({"model": {"w": sharded}})
    local = flat["model/w"]
    same_memory = local.data_ptr() == sharded.to_local().data_ptr()
    return local.tolist(), same_memory and type(local) is torch.Tensor


def test_flatten_state_takes_a_dtensors_local_shard():
    results = run_distributed(_flatten_a_dtensor, 2, timeout_s=60)
    assert results == [([[0.0, 1.0], [2.0, 3.0]], True), ([[4.0, 5.0], [6.0, 7.0]], True)]


def test_tensor_table_packs_aligned_and_round_trips_every_dtype_bitwise():
    flat = flatten_state(sample_state())
    table = tensor_table(flat)
    assert [entry.key for entry in table] == list(flat)
    ends = 0
    for entry in table:
        assert entry.offset % ALIGN == 0 and entry.offset >= ends
        assert entry.offset - ends < ALIGN  # packed: no more than the alignment's padding
        assert entry.nbytes == flat[entry.key].numel() * flat[entry.key].element_size()
        ends = entry.offset + entry.nbytes
    assert payload_size(table) >= ends and payload_size(table) % ALIGN == 0
    payload = pack(flat)
    for entry in table:
        view = tensor_view(payload, entry)
        assert view.dtype == flat[entry.key].dtype and view.shape == flat[entry.key].shape
        bits = view.reshape(-1).view(torch.uint8)
        assert torch.equal(bits, flat[entry.key].reshape(-1).view(torch.uint8))


def test_a_dtype_outside_the_allow_list_is_a_usage_error():
    with pytest.raises(GoodputError, match="complex64") as error:
        tensor_table({"model/w": torch.zeros(2, dtype=torch.complex64)})
    assert error.value.code == ExitCode.USAGE


def test_layout_digest_follows_keys_dtypes_shapes_not_values():
    flat = {"model/a": torch.zeros(2, 3), "model/b": torch.zeros(4)}
    digest = layout_digest(tensor_table(flat))
    assert digest == layout_digest(tensor_table({k: t + 1 for k, t in flat.items()}))
    for changed in (
        {"model/a": torch.zeros(3, 2), "model/b": torch.zeros(4)},
        {"model/a": torch.zeros(2, 3, dtype=torch.float64), "model/b": torch.zeros(4)},
        {"model/a": torch.zeros(2, 3), "model/c": torch.zeros(4)},
    ):
        assert layout_digest(tensor_table(changed)) != digest


def test_manifest_round_trips_through_bytes_and_a_file(tmp_path):
    manifest, _ = sample_manifest()
    assert parse_manifest(manifest_bytes(manifest), "partner rank 3") == manifest
    path = tmp_path / manifest_name("own", 1, 0)
    write_manifest(path, manifest)
    assert read_manifest(path) == manifest
    assert json.loads(path.read_bytes())["magic"] == "goodput-snapshot"


def _edited(edit) -> bytes:
    manifest, _ = sample_manifest()
    raw = json.loads(manifest_bytes(manifest))
    edit(raw)
    return json.dumps(raw).encode()


def _tensor(index: int, field: int, value: Any):
    def edit(raw: dict[str, Any]) -> None:
        raw["tensors"][index][field] = value

    return edit


def _set(key: str, value: Any):
    def edit(raw: dict[str, Any]) -> None:
        raw[key] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "what"),
    [
        (_set("magic", "goodput-snapshots"), "not a goodput-snapshot manifest"),
        (_set("version", True), "not a goodput-snapshot manifest"),
        (_set("extra", 1), "unknown \\['extra'\\]"),
        (lambda raw: raw.pop("rng"), "missing \\['rng'\\]"),
        (_set("step", 12.0), "step is 12.0"),
        (_set("rank", 4), "rank is 4"),
        (_set("run_id", "0123456789ABCDEF"), "run_id"),
        (_set("config_digest", "c" * 63), "config_digest"),
        (_set("hosts_shape", [3, 2]), "hosts_shape"),
        (_set("payload_bytes", 10**6), "payload_bytes"),
        (lambda raw: raw["chunks"].pop(), "chunk digests"),
        (_tensor(1, 3, 65), "at 65"),  # not aligned
        (_tensor(1, 3, 0), "at 0"),  # overlaps the first
        (_tensor(1, 4, 16), "with 16 bytes"),  # nbytes is not prod(shape) * itemsize
        (_tensor(1, 1, "complex64"), "not \\[key, dtype"),
        (_tensor(1, 2, [3, -5]), "not \\[key, dtype"),
        (_tensor(1, 0, "model/a"), "increasing key order"),
        (lambda raw: raw["tensors"].pop(0), "not at 0"),  # offsets no longer packed
        (_set("layout", "a" * 64), "layout is not the digest"),
        (lambda raw: raw["train_state"].update(step=11), "not the full state of step 12"),
        (lambda raw: raw["train_state"].pop("loader"), "no loader position"),
        (_set("rng", []), "rng is not"),
    ],
)
def test_parse_manifest_refuses_each_inconsistency(edit, what):
    with pytest.raises(GoodputError, match=what) as error:
        parse_manifest(_edited(edit), "held-00001.slot-0.json")
    assert str(error.value).startswith("held-00001.slot-0.json: memory snapshot manifest")


@pytest.mark.parametrize(
    "data", [b"", b"\xff", b"[]", b'{"magic": NaN}', b"[" * 100_000, b"1" * 5000]
)
def test_parse_manifest_refuses_what_is_not_a_json_object(data):
    with pytest.raises(GoodputError, match="memory snapshot manifest"):
        parse_manifest(data, "m.json")


@pytest.mark.parametrize("kind", ["symlink", "folder", "fifo", "missing", "huge", "foreign"])
def test_read_manifest_refuses_a_file_that_is_not_ours(tmp_path, kind):
    if kind == "foreign" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root (CI runs as root)")
    manifest, _ = sample_manifest()
    real = tmp_path / "real.json"
    write_manifest(real, manifest)
    path = tmp_path / manifest_name("held", 1, 0)
    if kind == "symlink":
        path.symlink_to(real)  # a valid manifest behind a link: refused
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # opened without blocking, then refused
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: refused by its size, never read
    elif kind == "foreign":
        real.rename(path)
        os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(GoodputError, match="memory snapshot file") as error:
        read_manifest(path)
    assert str(path) in str(error.value)
    if kind != "huge":  # own_file checks what a payload is before it is mapped: not its size
        with pytest.raises(GoodputError, match="memory snapshot file"):
            own_file(path)


def test_own_file_passes_our_regular_file(tmp_path):
    path = tmp_path / payload_name("own", 0, 1)
    path.write_bytes(b"\0" * 128)
    assert own_file(path).st_size == 128


def test_chunk_digests_are_each_chunks_sha256_in_order_with_any_workers():
    data = bytes(range(256)) * 41  # 10496 bytes: a short last chunk
    expected = [hashlib.sha256(data[i : i + 1000]).hexdigest() for i in range(0, len(data), 1000)]
    assert chunk_digests(memoryview(data), 1000) == expected
    assert chunk_digests(memoryview(data), 1000, workers=4) == expected
    assert chunk_digests(memoryview(b""), 1000) == []


def test_first_bad_chunk_names_the_damaged_chunk():
    manifest, payload = sample_manifest(chunk_bytes=256)
    assert first_bad_chunk(payload.numpy().data, manifest, workers=2) is None
    payload[600] ^= 1
    assert first_bad_chunk(payload.numpy().data, manifest) == 2
    assert first_bad_chunk(payload.numpy()[:-64].data, manifest) == 0


def test_names_and_folders(tmp_path, monkeypatch):
    assert payload_name("own", 3, 0) == "rank-00003.slot-0.bin"
    assert manifest_name("held", 3, 1) == "held-00003.slot-1.json"
    names = [f(k, r, s) for f in (payload_name, manifest_name) for k in ("own", "held")
             for r in (0, 123456) for s in (0, 1)]  # fmt: skip
    assert all(SNAPSHOT_FILE.fullmatch(name) for name in names)
    assert not SNAPSHOT_FILE.fullmatch("rank-00003.slot-0.bin.tmp")
    for bad in (("own", 3, 2), ("own", -1, 0), ("mine", 3, 0)):
        with pytest.raises(ValueError):
            payload_name(*bad)  # type: ignore[arg-type]
    key = run_key(tmp_path / "ckpt")
    assert len(key) == 16 and int(key, 16) >= 0
    monkeypatch.chdir(tmp_path)
    assert run_key(Path("ckpt")) == key and run_key(Path("other")) != key
    folder = host_folder(tmp_path, key, "n1")
    assert folder == tmp_path / f"goodput-{os.getuid()}" / key / "n1"
    for host in ("..", "n1/../x", "", "-n1"):
        with pytest.raises(GoodputError, match="not a host name"):
            host_folder(tmp_path, key, host)
    assert memory_root(str(tmp_path)) == tmp_path
    assert memory_root(None) in (Path("/dev/shm"), Path(tempfile.gettempdir()))


def test_ensure_private_dir_makes_0700_folders_and_closes_open_ones(tmp_path):
    folder = host_folder(tmp_path, "ab" * 8, "n1")
    assert ensure_private_dir(folder) == folder
    levels = [folder.parents[1], folder.parent, folder]
    assert all(stat.S_IMODE(level.stat().st_mode) == 0o700 for level in levels)
    os.chmod(folder.parent, 0o777)
    ensure_private_dir(folder)
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize("kind", ["symlink", "file", "foreign"])
def test_ensure_private_dir_refuses_a_level_that_is_not_our_folder(tmp_path, kind):
    if kind == "foreign" and os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root (CI runs as root)")
    folder = host_folder(tmp_path, "ab" * 8, "n1")
    hostile = folder.parent  # the run's level
    hostile.parent.mkdir(mode=0o700)
    if kind == "symlink":
        (tmp_path / "elsewhere").mkdir()
        hostile.symlink_to(tmp_path / "elsewhere")
    elif kind == "file":
        hostile.write_bytes(b"")
    else:
        hostile.mkdir(mode=0o700)
        os.chown(hostile, OTHER_UID, OTHER_UID)
    with pytest.raises(GoodputError) as error:
        ensure_private_dir(folder)
    assert str(hostile) in str(error.value)
    assert not (tmp_path / "elsewhere" / "n1").exists()


def test_pairing_examples():
    hosts = ["n1", "n1", "n2", "n2", "n3", "n3"]
    assert Pairing.from_hosts(hosts, 1) == Pairing(holder=3, source=5, num_hosts=3)
    assert Pairing.from_hosts(hosts, 4) == Pairing(holder=0, source=2, num_hosts=3)
    assert Pairing.from_hosts(["n2", "n1"], 0) == Pairing(holder=1, source=1, num_hosts=2)
    assert Pairing.from_hosts(["n1", "n1"], 0) == Pairing(holder=None, source=None, num_hosts=1)
    assert Pairing.from_hosts(["n1", "n1", "n2"], 2) == Pairing(
        holder=None, source=None, num_hosts=2
    )
    assert hosts_shape(hosts) == (3, 2) and hosts_shape(["n1", "n1", "n2"]) == (2, 0)


@st.composite
def _host_lists(draw: st.DrawFn) -> list[str]:
    """Every rank's host: H hosts of ppn ranks each, the ranks in any order."""
    num_hosts, ppn = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    return draw(st.permutations([f"n{h}" for h in range(num_hosts) for _ in range(ppn)]))


@PROPERTY
@given(hosts=_host_lists())
def test_a_partner_copy_is_always_on_another_host_and_pairs_are_inverse(hosts):
    pairings = [Pairing.from_hosts(hosts, rank) for rank in range(len(hosts))]
    if len(set(hosts)) == 1:
        assert all(p.holder is None and p.source is None for p in pairings)
        return
    for rank, pairing in enumerate(pairings):
        assert pairing.holder is not None and pairing.source is not None
        assert hosts[pairing.holder] != hosts[rank]
        assert pairings[pairing.holder].source == rank
    assert {p.holder for p in pairings} == set(range(len(hosts)))  # each rank holds one copy


_STEPS = st.lists(st.integers(-1, 6), max_size=2)


@PROPERTY
@given(data=st.data(), hosts=_host_lists(), at_least=st.integers(-1, 6))
def test_newest_complete_is_the_brute_force_answer(data, hosts, at_least):
    world = len(hosts)
    own = [data.draw(_STEPS) for _ in range(world)]
    held = [data.draw(_STEPS) for _ in range(world)]
    holders = [Pairing.from_hosts(hosts, rank).holder for rank in range(world)]

    def loadable(step: int, rank: int) -> bool:
        holder = holders[rank]
        return step in own[rank] or (holder is not None and step in held[holder])

    expected = next(
        (
            s
            for s in range(6, max(at_least, 0) - 1, -1)
            if all(loadable(s, r) for r in range(world))
        ),
        None,
    )
    assert newest_complete(own, held, holders, at_least=at_least) == expected


def test_newest_complete_reads_a_lost_hosts_ranks_from_their_partners():
    hosts = ["n1", "n2"]
    holders = [Pairing.from_hosts(hosts, rank).holder for rank in range(2)]
    # n2 was replaced: rank 1 has nothing of its own; rank 0 holds rank 1's steps 4 and 6.
    own, held = [[4, 6], []], [[4, 6], []]
    assert newest_complete(own, held, holders, at_least=0) == 6
    assert newest_complete(own, held, holders, at_least=7) is None
    assert newest_complete([[6], [-1]], [[-1], [6]], holders, at_least=0) is None


def test_ensure_private_dir_names_a_memory_dir_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-folder"
    with pytest.raises(GoodputError) as error:
        ensure_private_dir(host_folder(missing, "ab" * 8, "n1"))
    assert f"{missing}: does not exist; create it, or set [checkpoint] memory_dir" in str(
        error.value
    )
    assert not missing.exists()
