"""Activation checkpointing: what each block keeps for backward (``[parallel]
activation_checkpointing``), applied by ``parallelize`` after the tensor, expert and context
splits (so recompute sees the split block) and before ``torch.compile`` and FSDP.

- ``"full"``: the block keeps its input; backward runs its forward again. A third more compute
  for the blocks, the least memory.
- ``"op"`` (selective, per op): the block keeps the outputs of its matmuls and attention — the
  ops whose recompute is dear — and of tensor parallelism's reduce-scatters (so that recompute
  does not send them again); backward recomputes the rest (norms, rotary, activations, the
  elementwise products), which is cheap in compute and most of the memory. The all-gathers that
  feed the matmuls are recomputed, as torchtitan's per-op mode does: they are the bigger tensors.
  torchtitan's mode also recomputes every second matmul; this one keeps them all (more memory,
  no matmul recomputed), and the planner prices it so.
- ``"budget"``: torch.compile's partitioner keeps what fits in ``activation_memory_budget`` (a
  share of what ``"none"`` keeps) and recomputes the rest; only compiled blocks have a
  partitioner (``ParallelConfig`` refuses it without compile).

Recompute is exact on every path (no dropout, no random op in a block): the same losses and
gradients as ``"none"``, bit for bit on CPU. The checkpoint wrapper stays out of the weights'
names (DCP strips it), so a checkpoint loads across modes.
"""

from __future__ import annotations

import functools

import torch
import torch._functorch.config
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from goodput.train.config.parallel import ParallelConfig

_aten = torch.ops.aten
# "op" keeps these ops' outputs. Every attention kernel torch may pick is listed (CPU's, flash,
# memory-efficient, cuDNN); DTensor's reduce-scatter is the functional collective.
KEPT_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten._scaled_mm.default,  # fp8 matmuls (train/parallel/float8.py)
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
)
# torch's default: every activation kept, none recomputed by the partitioner.
NO_BUDGET = 1.0


def checkpoint_blocks(blocks: nn.ModuleDict, cfg: ParallelConfig) -> None:
    """Wrap each of ``blocks`` for ``cfg.activation_checkpointing`` (the module docstring), in
    place; set the compile partitioner's budget for ``"budget"`` (and torch's default for any
    other mode: the setting is process-wide, and one process may build several models)."""
    budget = cfg.activation_checkpointing == "budget"
    torch._functorch.config.activation_memory_budget = (
        cfg.activation_memory_budget if budget else NO_BUDGET
    )
    if cfg.activation_checkpointing not in ("full", "op"):
        return
    selective = cfg.activation_checkpointing == "op"
    for key, block in blocks.items():
        if selective:
            context = functools.partial(create_selective_checkpoint_contexts, _keep_dear_outputs)
            blocks[key] = checkpoint_wrapper(block, context_fn=context)
        else:
            blocks[key] = checkpoint_wrapper(block)


def _keep_dear_outputs(_context: object, op: object, *_args: object, **_kwargs: object) -> object:
    """Selective checkpointing's policy: keep ``KEPT_OPS``' outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE
