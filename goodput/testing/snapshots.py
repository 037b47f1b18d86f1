"""Fixtures of in-memory checkpoints (snapshots) shared by tests: a small nested checkpoint state
of every allowed dtype, its payload packed as the store packs it, and a valid manifest of it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from goodput.checkpoint.snapshot.format import (
    DTYPES,
    Manifest,
    chunk_digests,
    flatten_state,
    layout_digest,
    payload_size,
    tensor_table,
    tensor_view,
)
from goodput.checkpoint.state import rng_state

RUN_ID = "0123456789abcdef"
RUN_KEY = "fedcba9876543210"
CONFIG_DIGEST = "c" * 64


class LoaderPosition:
    """The loader's position: the train state's one required part."""

    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "loader": {"consumed_samples": self.consumed, "fingerprint": "test", "components": {}}
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.consumed = state["loader"]["consumed_samples"]


def sample_state(seed: int = 0) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as ``parts.gather`` merges it: odd sizes (so padding
    shows), a 0-dim step, an empty tensor, one tensor of every dtype of ``DTYPES``."""
    generator = torch.Generator().manual_seed(seed)

    def values(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    model = {f"layers.{name}.weight": values(3, 5).to(dtype) for name, dtype in DTYPES.items()}
    model["layers.empty.bias"] = torch.zeros(0)
    optim = {
        "layers.float32.weight": {
            "exp_avg": values(3, 5),
            "exp_avg_sq": values(3, 5).abs(),
            "step": torch.tensor(7.0),
        }
    }
    return {"model": model, "optim": optim}


def pack(flat: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``flat``'s tensors in one uint8 payload laid out by ``tensor_table``."""
    table = tensor_table(flat)
    payload = torch.zeros(payload_size(table), dtype=torch.uint8)
    for entry in table:
        tensor_view(payload, entry).copy_(flat[entry.key])
    return payload


def train_state(step: int, world_size: int) -> dict[str, Any]:
    """A train state ``load.check_train_state`` accepts, as a checkpoint writes it."""
    return {
        "step": step,
        "loader": {"consumed_samples": 64 * step, "fingerprint": "f" * 16, "components": {}},
        "world_size": world_size,
        "optimizer_param_groups": [{"lr": 0.001, "betas": [0.9, 0.95], "params": ["w"]}],
    }


def sample_manifest(
    state: Mapping[str, Any] | None = None,
    *,
    step: int = 12,
    rank: int = 1,
    world_size: int = 4,
    chunk_bytes: int = 256,
) -> tuple[Manifest, torch.Tensor]:
    """A valid manifest of ``state`` (``sample_state()`` by default) and its payload."""
    flat = flatten_state(sample_state() if state is None else state)
    table = tensor_table(flat)
    payload = pack(flat)
    manifest = Manifest(
        run_id=RUN_ID,
        run_key=RUN_KEY,
        step=step,
        rank=rank,
        world_size=world_size,
        hosts_shape=(2, world_size // 2),
        config_digest=CONFIG_DIGEST,
        layout=layout_digest(table),
        payload_bytes=payload_size(table),
        chunk_bytes=chunk_bytes,
        chunks=tuple(chunk_digests(payload.numpy().data, chunk_bytes)),
        tensors=table,
        train_state=train_state(step, world_size),
        rng=rng_state(torch.device("cpu")),
    )
    return manifest, payload
