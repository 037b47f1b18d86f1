"""The model's initial values, drawn by each rank for its own shard only.

A fresh run builds the model on the meta device, lays it out (``parallelize``, pipeline stages)
and allocates only this rank's shards; ``initialize_model`` then fills them. No rank ever holds
a whole parameter, so start-up memory follows the shard: a 405B model starts on devices that
could never hold it whole.

Layout invariance. Every parameter is cut into fixed blocks that depend only on its *global*
shape: groups of whole rows along dim 0, as many as fit in ``BLOCK_ELEMENTS`` (when one row is
bigger than that — a grouped expert's ``[dim, ffn]`` slice — each row is cut the same way along
its own dim 0, recursively). Block ``k`` of parameter ``name`` is drawn whole, always with the
same shape, from a generator seeded by (run seed, name, the block's index path) alone. A rank
draws the blocks its shard overlaps and copies out the overlap, found from the DTensor's global
offset. So an element's value is a function of (seed, name, position) — the same on one process
and in every FSDP/TP/EP/PP layout, which the layout-invariance tests check loss for loss. Names
are the whole model's (pipeline stages keep them; wrappers' name parts are dropped), and a
tied output head draws the embedding's values, so the first and last stage agree.

Cost per rank: the draws cover the rows its shard touches — its shard, or up to ``tp`` times it
for a weight split by column, plus at most one block's rows at each end — and the working set
is one block (``BLOCK_ELEMENTS`` fp32 values, 256 KiB) plus its slice on top of the shard. The
distributions are the model's: norms at 1, output projections (``wo``, ``w2``, the experts'
``w2``) normal with ``init_std / sqrt(2 · layers)``, every other weight normal with
``init_std``. Values depend on the device type (each device's generator has its own stream),
never on the layout.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from goodput.train.config.model import ModelConfig

# 64 Ki values: big enough that drawing a block costs far more than seeding its generator,
# small enough that a shard of a few rows (FSDP over thousands of ranks) draws little more.
BLOCK_ELEMENTS = 1 << 16
# Name parts that wrappers add (activation checkpointing, torch.compile): not the parameter's.
WRAPPER_NAME_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})
OUTPUT_PROJECTIONS = ("wo.weight", "w2.weight", "experts.w2")

Draw = Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor]


def initialize_model(parts: Sequence[nn.Module], cfg: ModelConfig, seed: int) -> None:
    """Fill every parameter of the allocated model ``parts`` (a whole model, or this rank's
    pipeline stages; plain tensors or DTensor shards) with this rank's share of the init."""
    for part in parts:
        for name, parameter in part.named_parameters():
            initialize_parameter(parameter, parameter_name(name, cfg), cfg, seed)


def parameter_name(name: str, cfg: ModelConfig) -> str:
    """The name whose values ``name`` takes: wrappers' parts dropped; a tied head's is the
    embedding's (on a pipeline's last stage it is a parameter of its own)."""
    name = ".".join(part for part in name.split(".") if part not in WRAPPER_NAME_PARTS)
    return "embedding.weight" if cfg.tie_embeddings and name == "output.weight" else name


def initialize_parameter(parameter: torch.Tensor, name: str, cfg: ModelConfig, seed: int) -> None:
    local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
    if local.is_meta or local.numel() == 0:
        return
    with torch.no_grad():
        if name.endswith("norm.weight"):
            local.fill_(1.0)
            return
        std = cfg.init_std
        if name.endswith(OUTPUT_PROJECTIONS):
            std /= math.sqrt(2 * cfg.num_layers)
        offset = global_offset(parameter)
        fill_region(local, tuple(parameter.shape), offset, normal_blocks(seed, name, std, local))


def global_offset(parameter: torch.Tensor) -> tuple[int, ...]:
    """Where this rank's shard of ``parameter`` starts in the whole tensor, per dim."""
    if not isinstance(parameter, DTensor):
        return (0,) * parameter.dim()
    shape, offset = compute_local_shape_and_global_offset(
        parameter.shape, parameter.device_mesh, parameter.placements
    )
    assert tuple(shape) == tuple(parameter.to_local().shape), (shape, parameter.to_local().shape)
    return tuple(offset)


def normal_blocks(seed: int, name: str, std: float, like: torch.Tensor) -> Draw:
    """``draw(path, shape)``: block ``path`` of ``name``, N(0, std²) in fp32 on ``like``'s
    device, from its own generator (seeded by the run seed, the name and the path only)."""

    def draw(path: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        key = f"{seed}|{name}|{','.join(map(str, path))}".encode()
        block_seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        generator = torch.Generator(device=like.device)
        generator.manual_seed(block_seed >> 1)  # a 63-bit seed: every backend takes it
        values = torch.empty(shape, dtype=torch.float32, device=like.device)
        return values.normal_(0.0, std, generator=generator)

    return draw


def fill_region(
    local: torch.Tensor,
    shape: tuple[int, ...],
    offset: tuple[int, ...],
    draw: Draw,
    path: tuple[int, ...] = (),
) -> None:
    """Fill ``local``, the region of a tensor of ``shape`` starting at ``offset``, with the
    values of that tensor's blocks (the module docstring's scheme)."""
    num_rows = local.shape[0]
    row_elements = math.prod(shape[1:])
    if row_elements > BLOCK_ELEMENTS:  # a row is more than a block: cut each row alike
        for row in range(num_rows):
            fill_region(local[row], shape[1:], offset[1:], draw, (*path, offset[0] + row))
        return
    rows_per_block = max(1, BLOCK_ELEMENTS // row_elements)
    first_row, end_row = offset[0], offset[0] + num_rows
    for block in range(first_row // rows_per_block, (end_row - 1) // rows_per_block + 1):
        block_start = block * rows_per_block
        block_end = min(block_start + rows_per_block, shape[0])
        values = draw((*path, block), (block_end - block_start, *shape[1:]))
        start, end = max(block_start, first_row), min(block_end, end_row)
        columns = tuple(
            slice(at, at + size) for at, size in zip(offset[1:], local.shape[1:], strict=True)
        )
        local[start - first_row : end - first_row].copy_(
            values[(slice(start - block_start, end - block_start), *columns)]
        )
