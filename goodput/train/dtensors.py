"""Reading DTensors as plain tensors, where code works on this rank's part of a value."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (the whole value when it is
    replicated), a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
