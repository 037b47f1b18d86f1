"""Fuzz ``goodput ckpt import``: HF ``config.json`` values and safetensors headers.

Property: the import writes a checkpoint or raises ``GoodputError``; never another exception,
and a refused import leaves OUT_DIR absent. Inputs: hostile values for the real config keys
(and any JSON at all), safetensors files built from random headers, and a valid tiny model's
file with some of its bytes replaced (mostly of the length prefix and header) or cut short.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save

from goodput.errors import GoodputError
from goodput.testing.tiny import TINY_MODEL
from goodput.train.config.model import ModelConfig
from goodput.train.convert import checkpoints, hf
from goodput.train.model import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CONFIG = hf.hf_config(TINY_MODEL)
KEYS = [*CONFIG, "rope_parameters", "partial_rotary_factor"]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, -1, 2**31, 2**53 + 1])
    | st.floats()
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)


def imports_or_refuses(folder: Path) -> None:
    out = Path(tempfile.mkdtemp(dir=folder.parent)) / "out"
    try:
        directory = checkpoints.import_hf(folder, out)
    except GoodputError as error:
        assert error.render().count("\n") == 0
        assert not out.exists()
    else:
        assert directory.is_dir()


@pytest.fixture(scope="module")
def valid_weights() -> bytes:
    return save(hf.to_hf(Transformer(TINY_MODEL).state_dict(), TINY_MODEL))


def hf_folder(base: Path, weights: bytes, config: object = CONFIG) -> Path:
    folder = Path(tempfile.mkdtemp(dir=base))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(weights)
    return folder


@given(changes=st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), json_values))
def test_config_json_with_hostile_values(changes):
    try:
        cfg = hf.model_config({**CONFIG, **changes}, "config.json")
    except GoodputError:
        return
    assert isinstance(cfg, ModelConfig)


@given(value=json_values)
def test_config_json_of_any_shape(value):
    with pytest.raises(GoodputError):
        hf.model_config(value, "config.json")


entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "Q4"]) | json_values,
        "shape": st.lists(st.integers(-2, 2**64), max_size=4) | json_values,
        "data_offsets": st.lists(st.integers(-2, 80), max_size=3) | json_values,
    }
)
headers = st.dictionaries(
    st.sampled_from(["model.norm.weight", "__metadata__"]) | st.text(max_size=8),
    entries | json_values,
    max_size=4,
)


@given(
    header=headers.map(lambda h: json.dumps(h).encode()) | st.binary(max_size=40),
    data=st.binary(max_size=80),
    length=st.none() | st.integers(0, 2**64 - 1),
)
def test_safetensors_from_random_headers(tmp_path, header, data, length):
    prefix = struct.pack("<Q", len(header) if length is None else length)
    imports_or_refuses(hf_folder(tmp_path, prefix + header + data))


@given(data=st.data())
def test_a_valid_file_with_its_header_mutated_or_cut(tmp_path, valid_weights, data):
    weights = bytearray(valid_weights)
    header_end = 8 + int.from_bytes(weights[:8], "little")
    for _ in range(data.draw(st.integers(1, 4))):
        # Mostly the length prefix and header; sometimes data (NaN, inf: refused on import).
        end = data.draw(st.sampled_from([header_end, header_end, len(weights)]))
        weights[data.draw(st.integers(0, end - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.none() | st.integers(0, len(weights)))
    imports_or_refuses(hf_folder(tmp_path, bytes(weights[:cut])))


def test_the_valid_file_imports(tmp_path, valid_weights):
    """The control: unmutated, the same folder imports."""
    folder = hf_folder(tmp_path, valid_weights)
    assert checkpoints.import_hf(folder, tmp_path / "out").is_dir()


HF_SHAPES = {
    name: list(tensor.shape)
    for name, tensor in hf.to_hf(Transformer(TINY_MODEL).state_dict(), TINY_MODEL).items()
}


@given(
    name=st.sampled_from(sorted(HF_SHAPES)),
    shape=st.lists(st.integers(1, 130), min_size=1, max_size=3),
)
def test_a_tensor_of_any_shape(tmp_path, name, shape):
    """The right names, one tensor of any shape: imported only at its config's shape, else
    refused naming the file and the tensor (its header is read before any tensor)."""
    tensors = {n: torch.zeros(s) for n, s in {**HF_SHAPES, name: shape}.items()}
    folder = hf_folder(tmp_path, save(tensors))
    out = Path(tempfile.mkdtemp(dir=tmp_path)) / "out"
    try:
        checkpoints.import_hf(folder, out)
    except GoodputError as error:
        assert shape != HF_SHAPES[name] and not out.exists()
        assert error.where == str(folder / "model.safetensors") and repr(name) in error.what
    else:
        assert shape == HF_SHAPES[name]
