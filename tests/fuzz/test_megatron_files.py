"""Fuzz ``goodput ckpt import --from megatron-legacy|deepspeed``: Megatron's saved args, the
folders' tracker files, and the pickles themselves.

Property: a model-only checkpoint or a ``GoodputError``; never another exception, nothing run
from a pickle, and a refused import leaves no checkpoint. The source is a legacy checkpoint of
one TP x PP rank written here in Megatron-core's names from a goodput model's weights (Megatron
itself writes the ones the unit tests read; here only the bytes matter), then given hostile
args, or some of its bytes replaced or cut.
"""

from __future__ import annotations

import argparse
import io
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.testing.tiny import TINY_MODEL
from goodput.train.convert import checkpoints, megatron, megatron_files
from goodput.train.convert.hf import interleaved_to_halves
from goodput.train.convert.pickles import load_torch_file
from goodput.train.model import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CFG = TINY_MODEL
ARGS = {
    "num_layers": CFG.num_layers,
    "hidden_size": CFG.dim,
    "num_attention_heads": CFG.num_heads,
    "num_query_groups": CFG.kv_heads,
    "group_query_attention": True,
    "ffn_hidden_size": CFG.mlp_dim,
    "norm_epsilon": CFG.norm_eps,
    "rotary_base": CFG.rope_theta,
    "padded_vocab_size": CFG.vocab_size,
    "untie_embeddings_and_output_weights": True,
    "normalization": "RMSNorm",
    "swiglu": True,
    "use_rope_scaling": False,
}
values = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
)
any_values = st.recursive(
    values, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner)
)


def megatron_state() -> dict[str, torch.Tensor]:
    """A tiny goodput model's weights in Megatron-core's names and fused layouts."""
    torch.manual_seed(0)
    state = Transformer(CFG).state_dict()
    out = {
        "embedding.word_embeddings.weight": state["embedding.weight"],
        "decoder.final_layernorm.weight": state["norm.weight"],
        "output_layer.weight": state["output.weight"],
    }
    group = CFG.num_heads // CFG.kv_heads
    for i in range(CFG.num_layers):
        block, layer = f"blocks.{i}.", f"decoder.layers.{i}."
        wq = interleaved_to_halves(state[block + "attention.wq.weight"], CFG.num_heads)
        wk = interleaved_to_halves(state[block + "attention.wk.weight"], CFG.kv_heads)
        wv = state[block + "attention.wv.weight"]
        fused = torch.cat(
            [
                wq.view(CFG.kv_heads, group, CFG.head_dim, CFG.dim),
                wk.view(CFG.kv_heads, 1, CFG.head_dim, CFG.dim),
                wv.view(CFG.kv_heads, 1, CFG.head_dim, CFG.dim),
            ],
            dim=1,
        )
        out |= {
            layer + "input_layernorm.weight": state[block + "attention_norm.weight"],
            layer + "self_attention.linear_qkv.weight": fused.reshape(-1, CFG.dim),
            layer + "self_attention.linear_proj.weight": state[block + "attention.wo.weight"],
            layer + "pre_mlp_layernorm.weight": state[block + "mlp_norm.weight"],
            layer + "mlp.linear_fc1.weight": torch.cat(
                [state[block + "mlp.w1.weight"], state[block + "mlp.w3.weight"]]
            ),
            layer + "mlp.linear_fc2.weight": state[block + "mlp.w2.weight"],
        }
    return out


def legacy_bytes(args: object) -> bytes:
    buffer = io.BytesIO()
    torch.save({"args": args, "iteration": 1, "model": megatron_state()}, buffer)
    return buffer.getvalue()


VALID = legacy_bytes(argparse.Namespace(**ARGS))


def import_legacy(data: bytes, tracker: str | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "src"
        rank = root / "iter_0000001" / "mp_rank_00"
        rank.mkdir(parents=True)
        (rank / "model_optim_rng.pt").write_bytes(data)
        if tracker is not None:
            (root / megatron_files.MEGATRON_TRACKER).write_text(tracker)
        config = Path(tmp) / "model.toml"
        config.write_text(checkpoints.model_config_toml(CFG))
        out = Path(tmp) / "run"
        try:
            checkpoints.import_megatron(root, "megatron-legacy", config, out)
        except GoodputError:
            assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def test_the_valid_source_imports():
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "src" / "mp_rank_00"
        root.mkdir(parents=True)
        (root / "model_optim_rng.pt").write_bytes(VALID)
        config = Path(tmp) / "model.toml"
        config.write_text(checkpoints.model_config_toml(CFG))
        directory = checkpoints.import_megatron(
            root.parent, "megatron-legacy", config, Path(tmp) / "r"
        )
        loaded = checkpoints.load_model_state(directory, CFG)
    torch.manual_seed(0)
    expected = Transformer(CFG).state_dict()
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)


@given(st.dictionaries(st.sampled_from([*ARGS, *megatron.ARGS_REQUIRED]), any_values, max_size=4))
def test_hostile_args_are_refused_in_one_line(changes):
    args = {**ARGS, **changes}
    try:
        megatron.check_args(args, CFG, "SRC", "model.toml")
    except GoodputError as exc:
        assert "\n" not in exc.what and len(exc.what) < 1000


@given(any_values)
def test_args_of_any_shape_import_or_are_refused(args):
    import_legacy(legacy_bytes(args))


@given(st.text(max_size=30))
def test_any_tracker_text_picks_a_folder_inside_the_root_or_is_refused(text):
    import_legacy(VALID, tracker=text)


def pickle_of(data: bytes) -> tuple[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        return name, archive.read(name)


def with_pickle(data: bytes, replacement: bytes) -> bytes:
    """``data`` (a torch.save zip) with its pickle replaced, every other entry kept."""
    name, _ = pickle_of(data)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as old, zipfile.ZipFile(out, "w") as new:
        for entry in old.namelist():
            new.writestr(entry, replacement if entry == name else old.read(entry))
    return out.getvalue()


@given(st.data())
def test_a_pickle_with_bytes_replaced_imports_or_is_refused(data):
    _, original = pickle_of(VALID)
    mutated = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        mutated[data.draw(st.integers(0, len(mutated) - 1))] = data.draw(st.integers(0, 255))
    import_legacy(with_pickle(VALID, bytes(mutated)))


@given(st.binary(max_size=200), st.integers(0, len(VALID)))
def test_a_file_cut_or_of_random_bytes_is_refused(junk, cut):
    import_legacy(VALID[:cut])
    import_legacy(junk)


@given(
    st.sampled_from(["os", "posix", "builtins", "__builtin__", "subprocess", "torch", "shutil"]),
    st.sampled_from(["system", "eval", "exec", "Popen", "getattr", "load", "rmtree", "open"]),
)
def test_a_pickle_naming_any_other_global_is_refused_before_it_is_looked_up(module, name):
    _, original = pickle_of(legacy_bytes(None))
    # A protocol-2 GLOBAL and a call of it with no arguments, ahead of the real object: the
    # first opcode the reader meets names the global.
    hostile = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b")R0" + original[2:]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.pt"
        path.write_bytes(with_pickle(VALID, hostile))
        shown = "builtins" if module == "__builtin__" else module  # Python 2's name, mapped
        with pytest.raises(GoodputError, match=f"refused to load {shown}.{name}"):
            load_torch_file(path)


def test_the_plain_values_a_checkpoint_holds_come_back_and_bytearray_n_is_refused(tmp_path):
    """torch.save writes protocol 2 (Python 2's module names): each plain type Megatron's and
    DeepSpeed's files hold is rebuilt; ``bytearray(n)``, which would allocate n bytes, is not."""
    values = {
        "set": {1, 2},
        "frozenset": frozenset([3]),
        "complex": 1 + 2j,
        "slice": slice(1, 2),
        "bytes": bytearray(b"xy"),
        "args": argparse.Namespace(params_dtype=torch.bfloat16, seed=1),
        "size": torch.Size([2, 3]),
    }
    buffer = io.BytesIO()
    torch.save(values, buffer)
    path = tmp_path / "plain.pt"
    path.write_bytes(buffer.getvalue())
    assert load_torch_file(path) == values
    _, original = pickle_of(buffer.getvalue())
    # bytearray(10**12) then the real object: the reader meets the call first.
    hostile = b"\x80\x02c__builtin__\nbytearray\nJ\x00\x10\xa5\xd4\x85R0" + original[2:]
    path.write_bytes(with_pickle(buffer.getvalue(), hostile))
    with pytest.raises(GoodputError, match="bytearray of anything but bytes or text"):
        load_torch_file(path)
