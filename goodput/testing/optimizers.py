"""What the optimizer tests share beside their one contract (tests/unit/train/
test_optimizer_contract.py): seeded problems, the small model the matrix kinds are tested on
with its groups, and parameters laid out on a 2x2 (dp, tp) mesh."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Placement, Replicate, Shard

# (shape, parameter placements on the (dp, tp) mesh, gradient placements, weight decay)
LAYOUTS_2D: list[tuple[tuple[int, ...], tuple[Placement, ...], tuple[Placement, ...], float]] = [
    ((6, 4), (Shard(0), Shard(1)), (Replicate(), Replicate()), 0.1),  # gradient redistributed
    ((5, 6), (Shard(1), Shard(0)), (Shard(1), Shard(0)), 0.1),  # 5 rows over tp: uneven
    ((3, 4), (Replicate(), Shard(1)), (Replicate(), Shard(1)), 0.1),
    ((4, 4), (Replicate(), Replicate()), (Replicate(), Replicate()), 0.1),
    ((7,), (Shard(0), Replicate()), (Shard(0), Replicate()), 0.0),
]


def random_problem(
    shapes: Sequence[tuple[int, ...]], num_steps: int = 3, seed: int = 0
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Weights of ``shapes`` (scaled by 0.3), then ``num_steps`` steps of their gradients, from
    one seeded generator (so the weights do not depend on ``num_steps``)."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=generator) * 0.3 for s in shapes]
    grads = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(num_steps)]
    return weights, grads


def small_model() -> nn.Sequential:
    """Three linear layers: 6x4, 5x6 (5 rows: uneven on 2 and 4 ranks) and 3x5 weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3))


def model_groups(model: nn.Sequential) -> list[dict[str, Any]]:
    """A matrix kind's groups of ``small_model``: its weights as matrices, its biases not."""
    return [
        {"params": [m.weight for m in model], "matrix": True},
        {"params": [m.bias for m in model], "matrix": False},
    ]


def matrix_groups(params: Sequence[nn.Parameter], transposed: Sequence[bool]) -> list[dict]:
    """One matrix group per parameter, each saying whether it is stored [in, out]."""
    return [
        {"params": [p], "matrix": True, "transposed": t}
        for p, t in zip(params, transposed, strict=True)
    ]


def sharded_and_whole(mesh: DeviceMesh) -> tuple[nn.Sequential, nn.Sequential]:
    """A seeded 6 -> 5 -> 3 MLP (5 and 3 rows: uneven over 2 ranks) FSDP2-sharded over
    ``mesh``, and the same model whole, for a test to step both and compare."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    whole = copy.deepcopy(model)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, whole


def backward_on_shares(
    sharded: nn.Module, whole: nn.Module, rank: int, world_size: int, scale: float = 1.0
) -> int:
    """One random batch of 4 rows a rank, from the global seed: ``sharded`` backpropagates
    ``scale`` times the MSE of this rank's rows, ``whole`` of all of them (the same gradients,
    once FSDP has reduced them); the batch's rows."""
    x, y = torch.randn(4 * world_size, 6), torch.randn(4 * world_size, 3)
    mine = slice(4 * rank, 4 * (rank + 1))
    (scale * F.mse_loss(sharded(x[mine]), y[mine])).backward()
    (scale * F.mse_loss(whole(x), y)).backward()
    return len(x)
