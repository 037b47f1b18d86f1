"""The format of an in-memory checkpoint (``goodput.checkpoint.snapshot.format``): tensor tables
and payload views, manifests written and read back strictly, chunk digests."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import torch

from goodput.checkpoint.snapshot.files import manifest_name, read_manifest, write_manifest
from goodput.checkpoint.snapshot.format import (
    ALIGN,
    chunk_digests,
    first_bad_chunk,
    flatten_state,
    layout_digest,
    manifest_bytes,
    parse_manifest,
    payload_size,
    tensor_table,
    tensor_view,
)
from goodput.errors import ExitCode, GoodputError
from goodput.testing.dist import run_distributed
from goodput.testing.snapshots import pack, sample_manifest, sample_state


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
        (
            lambda raw: raw["train_state"].pop("loader"),
            "train_state: field loader must be an object",
        ),
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
