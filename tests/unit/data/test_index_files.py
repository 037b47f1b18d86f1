"""A blend's index arrays from disk: replaced, flipped, pickled or old ones never reach a run."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from goodput.data.blend import BlendSpec, BlendStage, build_blend
from goodput.data.index_files import IndexFile, load_array
from goodput.data.loader import BlendedSamples
from goodput.errors import GoodputError


@pytest.fixture
def blend(three_corpora, tmp_path):
    file_list, _ = three_corpora
    spec = BlendSpec(
        stages=(BlendStage(file_list, 0),),
        seq_len=32,
        num_samples=512,
        seed=3,
        cache=tmp_path / "cache",
    )
    directory, manifest = build_blend(spec)
    return spec, directory, manifest


def verify(path):
    """``goodput data verify`` in a real process: (exit code, stdout + stderr)."""
    result = subprocess.run(
        [sys.executable, "-m", "goodput", "data", "verify", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in result.stderr
    return result.returncode, result.stdout + result.stderr


def loader_error(directory):
    with pytest.raises(GoodputError) as exc:
        BlendedSamples(directory)
    return exc.value.render()


def test_every_index_array_is_pinned_by_its_checksum(blend):
    _, directory, manifest = blend
    recorded = json.loads((directory / "blend.json").read_text())["index_sha256"]
    assert recorded == manifest["index_sha256"]
    names = {"corpus_index.npy", "sample_index.npy", "corpus_0000.npy", "corpus_0002.npy"}
    assert names <= set(recorded)
    per_shard = [key for key in recorded if key.startswith("files/")]
    assert len(per_shard) == 2 * len(manifest["shards"])
    assert verify(directory) == (0, f"{directory / 'blend.json'}: ok\n")


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["replaced", "flipped"])
def test_a_changed_corpus_index_is_caught_by_verify_and_the_loader(blend, damage):
    _, directory, _ = blend
    target = directory / "corpus_index.npy"
    if damage == "replaced":  # same dtype and length, other content: only the checksum knows
        np.save(target, np.zeros(512, np.int16))
    else:
        flip_last_byte(target)
    code, output = verify(directory)
    assert code == 1 and f"{target}: corrupt blend index: checksum mismatch" in output
    assert "FAILED, 1 problem(s)" in output
    assert loader_error(directory).startswith(f"{target}: corrupt blend index: checksum mismatch")


def test_a_changed_per_shard_index_is_caught_and_not_reused(blend):
    spec, directory, manifest = blend
    order = next((spec.cache / "files").iterdir()) / "document_order.npy"
    flip_last_byte(order)
    assert f"{order}: corrupt blend index: checksum mismatch" in verify(directory)[1]
    assert str(order) in loader_error(directory)
    # A new blend (another length) would reuse the per-shard index: it refuses the damaged one.
    with pytest.raises(GoodputError, match="checksum mismatch") as exc:
        build_blend(dataclasses.replace(spec, num_samples=600))
    assert f"delete {order.parent} and rerun" in exc.value.render()


def test_a_deleted_per_shard_index_is_rebuilt_identical_on_a_cache_hit(blend):
    spec, directory, _ = blend
    folder = next((spec.cache / "files").iterdir())
    before = (folder / "document_order.npy").read_bytes()
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    assert build_blend(spec)[0] == directory
    assert (folder / "document_order.npy").read_bytes() == before
    BlendedSamples(directory)


def test_an_object_array_is_refused_without_unpickling(blend, tmp_path):
    _, directory, _ = blend
    target = directory / "sample_index.npy"
    marker = tmp_path / "ran"
    # A pickle whose loading would create the marker file: it must never run.
    payload = np.array([Exploit(marker)] * 512, dtype=object)
    np.save(target, payload, allow_pickle=True)
    assert loader_error(directory).startswith(
        f"{target}: corrupt blend index: dtype object, expected int64"
    )
    assert "dtype object" in verify(directory)[1]
    assert not marker.exists()


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (lambda: np.zeros(511, np.int16), r"shape \(511,\), blend.json implies \(512,\)"),
        (lambda: np.zeros((512, 1), np.int16), r"shape \(512, 1\)"),
        (lambda: np.zeros(512, np.int64), "dtype int64, expected int16"),
        (lambda: np.zeros(512, ">i2"), "dtype >i2, expected int16"),
        (lambda: b"not numpy at all", "not a valid .npy file"),
        (lambda: b"\x93NUMPY\x01\x00\x10\x00{'descr': '<i2', ", "not a valid .npy file"),
        (lambda: b"\x93NUMPY\x03\x00", r"unsupported .npy format version \(3, 0\)"),
    ],
)
def test_malformed_arrays_are_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "corpus_index.npy"
    value = content()
    if isinstance(value, bytes):
        path.write_bytes(value)
    else:
        np.save(path, value)
    with pytest.raises(GoodputError, match=message) as exc:
        load_array(IndexFile(path, (np.dtype("<i2"),), 512))
    assert exc.value.render().startswith(f"{path}: corrupt blend index")


def test_a_truncated_array_is_refused(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.arange(100, dtype=np.int64))
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(GoodputError, match="its header implies"):
        load_array(IndexFile(path, (np.dtype("<i8"),), 100))
    with pytest.raises(GoodputError, match="missing"):
        load_array(IndexFile(tmp_path / "none.npy", (np.dtype("<i8"),), 100))


def test_a_blend_built_without_checksums_is_refused_with_the_fix(blend):
    spec, directory, _ = blend
    path = directory / "blend.json"
    manifest = json.loads(path.read_text())
    del manifest["index_sha256"]  # as goodput 0.1.0 wrote it (not fingerprinted)
    manifest["goodput_version"] = "0.1.0"
    path.write_text(json.dumps(manifest))
    expected = (
        f"{path}: built by goodput 0.1.0 without index checksums, so a changed index could not "
        f"be noticed; delete {directory} and rerun `goodput data blend`"
    )
    assert loader_error(directory).startswith(expected)
    code, output = verify(directory)
    assert code == 1 and expected in output
    with pytest.raises(GoodputError, match="without index checksums"):
        build_blend(spec)  # a cache hit is checked as the loader checks it
