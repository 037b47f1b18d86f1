"""What a checkpoint holds besides tensors: the run's registered parts, and every RNG of a rank.

``CheckpointContents`` is what a run registers with its ``Checkpointer`` once: this rank's model
parts and their optimizers (the tensors), its config, and the ``Stateful`` parts whose entries
make up ``train_state.json`` (the loader's position, the trainer's counters and diagnostics). The
same contents are what a resume loads into (``load.load_checkpoint``). Each part owns fixed
top-level keys of that file — the keys it always had, so checkpoints saved before the parts were
registered load unchanged — and no two parts share one.

RNG states: Python's, NumPy's, torch's CPU and device ones, as JSON. JSON, not pickle: a
checkpoint is read back on another day, maybe from another user's folder, and must never be able
to run code. Byte states travel as base64.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from goodput.checkpoint.parts import check_param_groups
from goodput.errors import GoodputError


class Stateful(Protocol):
    """A part of the run whose state travels in ``train_state.json``."""

    def state_dict(self) -> dict[str, Any]:
        """Its entries of the train state, under its own fixed keys (JSON values)."""
        ...

    def load_state_dict(self, train_state: Mapping[str, Any]) -> None:
        """Take its entries back from ``train_state`` (which may hold others'); an entry that is
        absent (a checkpoint saved before the part existed) leaves the part as it was built. A
        damaged entry is a ``ValueError`` (or a ``GoodputError`` naming what is wrong)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointContents:
    """What a run saves and resumes, registered once: this rank's model ``parts`` (one per
    pipeline stage it runs, else the whole model), their ``optimizers``, the train state's
    ``states`` by part name, and the resolved config as TOML."""

    parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    states: Mapping[str, Stateful] = field(default_factory=dict)
    config_toml: str = ""

    def train_state(self) -> dict[str, Any]:
        """Every part's entries, in one table."""
        merged: dict[str, Any] = {}
        for name, part in self.states.items():
            entries = part.state_dict()
            shared = merged.keys() & entries.keys()
            assert not shared, f"state part {name} writes keys another part owns: {shared}"
            merged |= entries
        return merged

    def load_train_state(self, train_state: Mapping[str, Any], source: Path) -> None:
        """Hand ``train_state`` (read from ``source``, checked as data by
        ``load.check_train_state``) to every part, before any tensor is read; a damaged entry
        is one line naming the file. Its optimizer groups are checked against this run's
        optimizers first; each part checks its own entries (the loader its position within
        this run's blend) before it takes them."""
        groups = train_state.get("optimizer_param_groups")  # none in a model-only one
        if groups is not None:
            check_param_groups(self.optimizers, groups, source)
        for part in self.states.values():
            try:
                part.load_state_dict(train_state)
            except ValueError as error:
                raise GoodputError(
                    source, f"damaged: {error}", "resume from another checkpoint (--resume)"
                ) from None


def rng_state(device: torch.device) -> dict[str, Any]:
    version, python_state, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    assert isinstance(keys, np.ndarray)  # the legacy form: (name, key array, position, ...)
    device_state = get_device_rng_state(device)
    return {
        "python": [version, list(python_state), gauss],
        "numpy": [kind, keys.tolist(), int(position), int(has_gauss), float(cached)],
        "torch": _encode(torch.get_rng_state()),
        "device": _encode(device_state) if device_state is not None else None,
    }


def set_rng_state(state: Any, device: torch.device, source: Path) -> None:
    """Restore what ``rng_state`` saved; anything else in ``source`` is a ``GoodputError``."""
    try:
        version, python_state, gauss = state["python"]
        kind, keys, position, has_gauss, cached = state["numpy"]
        python = (version, tuple(python_state), gauss)
        numpy = (kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached)
        torch_state = _decode(state["torch"])
        device_state = None if state["device"] is None else _decode(state["device"])
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(torch_state)
        if device_state is not None:
            set_device_rng_state(device, device_state)
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, RuntimeError) as exc:
        # Each generator checks its own state; whatever fails, nothing of this file is trusted.
        raise GoodputError(
            source,
            f"not a goodput RNG state ({type(exc).__name__}: {exc})",
            "resume from another checkpoint, or delete this file to reseed this rank's RNGs",
        ) from None


def _encode(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def get_device_rng_state(device: Any) -> Any:
    """The generator state of an accelerator (a uint8 tensor), or None for CPU and MPS, whose
    draws come from the CPU generator."""
    if device.type in ("cuda", "xpu"):
        return getattr(torch, device.type).get_rng_state(device)
    return None


def set_device_rng_state(device: Any, state: Any) -> None:
    if device.type in ("cuda", "xpu"):
        getattr(torch, device.type).set_rng_state(state, device)
