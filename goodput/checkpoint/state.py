"""Every random generator of one rank, as JSON: Python's, NumPy's, torch's CPU and device ones.

JSON, not pickle: a checkpoint is read back on another day, maybe from another user's folder,
and must never be able to run code. Byte states travel as base64.
"""

from __future__ import annotations

import base64
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from goodput.errors import GoodputError


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
