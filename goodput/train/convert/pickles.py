"""The one reader of ``torch.save`` files that other frameworks wrote: Megatron-LM's
``model_optim_rng.pt``, Megatron-core's ``common.pt``, DeepSpeed's ``*_model_states.pt``.

These files are pickles that hold more than tensors: Megatron's args (an ``argparse.Namespace``
holding enums of Megatron's own), numpy RNG states, DeepSpeed's loss scaler. torch's
``weights_only`` loader refuses the first of those, and the unrestricted loader runs whatever a
file says. Here torch's zip reader is given an unpickler that calls only what rebuilding data
needs (``CALLABLE``: tensors, ordered dicts, namespaces, sizes, dtypes) and never imports a
class of another framework: a global of ``megatron``, ``deepspeed``, ``transformer_engine``,
``apex``, ``numpy`` or ``io`` becomes an ``Opaque`` stand-in that keeps its arguments and state
as data. Any other global (``os.system``, ``builtins.eval``, ``subprocess.Popen``...) is refused
before it is looked up, so nothing a hostile file names ever runs.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import pickle
import types
import zipfile
from pathlib import Path
from typing import Any

import torch

from goodput.errors import GoodputError
from goodput.io import open_regular


def _bytes_of(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` as pickle protocol 2 uses it for bytes: text in, bytes out."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8"):
        raise pickle.UnpicklingError("refused _codecs.encode of anything but text to bytes")
    return text.encode(encoding)


def _bytearray_of(*args: Any) -> bytearray:
    """``bytearray`` as pickle protocols 2-4 use it, from bytes or text; never ``bytearray(n)``,
    which would allocate whatever size the file names."""
    if not args or not isinstance(args[0], (bytes, str)):
        raise pickle.UnpicklingError("refused bytearray of anything but bytes or text")
    return bytearray(*args)


# Every global a checkpoint's pickle may call, each only rebuilding plain data.
CALLABLE = {
    ("_codecs", "encode"): _bytes_of,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "bytearray"): _bytearray_of,
    ("builtins", "complex"): complex,
}
# Frameworks whose classes may appear beside the weights; they are kept as data, not imported.
# ``io``: Transformer Engine's layers saved their ``_extra_state`` as an ``io.BytesIO``.
OPAQUE_PACKAGES = frozenset(
    {"megatron", "deepspeed", "transformer_engine", "apex", "numpy", "io", "_io"}
)


class Opaque:
    """A stand-in for a class or function of another framework: called, it records its
    arguments; unpickled, its state. Its methods are pickle's, nothing else."""

    qualified_name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualified_name}, not imported>"


def _opaque(module: str, name: str) -> type[Opaque]:
    return types.new_class(
        name, (Opaque,), exec_body=lambda ns: ns.update(qualified_name=f"{module}.{name}")
    )


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # torch.save writes protocol 2, which names Python 2's modules (``__builtin__.set``);
        # pickle maps them to Python 3's in its own find_class, replaced here, so here too.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[module, name]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in CALLABLE:
            return CALLABLE[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.split(".")[0] in OPAQUE_PACKAGES:
            return _opaque(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: not checkpoint data")


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` needs: torch subclasses ``Unpickler`` and
    resolves its own storage classes first, then asks ``_Unpickler.find_class``."""

    Unpickler = _Unpickler
    load = None  # torch's zip reader never calls it; the legacy (non-zip) format is refused


def load_torch_file(path: Path) -> Any:
    """The object a ``torch.save`` zip file holds, tensors memory-mapped on the CPU; a refusal
    naming the file for anything but checkpoint data, a torn file or another format."""
    try:
        with open_regular(path):  # a FIFO or device is named before torch touches it
            pass
        if not zipfile.is_zipfile(path):
            raise GoodputError(
                path,
                "is not a torch.save zip file (the pre-1.6 format is not read)",
                "pass the checkpoint's own file, or re-save it with torch >= 1.6",
            )
        return torch.load(
            path, map_location="cpu", mmap=True, weights_only=False, pickle_module=_PickleModule
        )
    except GoodputError:
        raise
    except Exception as exc:  # a hostile or torn pickle fails in many ways; each is a refusal
        detail = " ".join(str(exc).split())[:300]
        raise GoodputError(
            path,
            f"refused ({type(exc).__name__}: {detail}); nothing in it was run",
            "pass a checkpoint written by Megatron or DeepSpeed; this file is damaged or not one",
        ) from None
