"""``compile_blocks``: ``torch.compile`` each block of a model or pipeline stage, in every layout.

``parallelize`` calls it after tensor, expert and context parallelism and activation
checkpointing have wrapped the blocks, and before FSDP. What is compiled is each block's own
``forward``: the collectives that TP puts inside a block are traced with it; ring attention's
point-to-point exchanges (CP) and the experts' all-to-all with data-dependent splits (EP) break
the graph and run uncompiled between compiled pieces. The block's module hooks (FSDP's
all-gathers and reduce-scatters among them) and its activation checkpointing run uncompiled
around it, as they do without compile.

Two torch 2.13 bugs decide that shape; each has its reproduction in
``tests/unit/train/test_compile_layouts.py``, marked to fail until torch mends it (then the
workaround can go):

- An input still in flight. Under sequence parallelism the embedding's output reaches the first
  block as an ``AsyncCollectiveTensor`` (``RowwiseParallel`` reduce-scatters it with
  ``async_op=True``). A compiled function fed one routes the gradient of that input to the
  reduce-scatter's backward as a plain tensor, which fails there (``'Tensor' object has no
  attribute '_local_tensor'``; the "gradient norm 0.65 for 0.85" once seen under FSDP came from
  the same input). ``_wait_in_flight`` waits for it before the compiled code (a copy of one
  ``[batch, tokens / tp, dim]`` activation per step; other inputs pass untouched).
  ``test_torch_routes_an_in_flight_inputs_gradient_wrong``.
- Checkpointing traced inside the compiled code. With a tensor-parallel attention, torch
  saves the ``DeviceMesh`` among the tensors for backward and fails (``expected all
  tensors_saved_with_vc_check to be Tensors``). So the checkpointing wraps the compiled forward
  instead: it recomputes the compiled forward in backward, the same numbers.
  ``test_torch_saves_a_device_mesh_as_a_tensor_under_compiled_checkpointing``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch._functorch.config
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper


def compile_blocks(blocks: nn.ModuleDict) -> None:
    """Compile the forward of each of ``blocks`` (a model's or a pipeline stage's) in place,
    inside its checkpointing; its inputs waited for first (the module docstring)."""
    # The memory budget's partitioner ("budget" checkpointing) sizes every value a compiled block
    # could keep, and refuses the opaque objects it cannot: under TP, the DeviceMesh the DTensor
    # ops take, which holds no tensors (zero bytes is its true size). Inert without a budget.
    torch._functorch.config.unsafe_treat_script_objects_as_zero_size = True
    for block in blocks.values():
        block.register_forward_pre_hook(_wait_in_flight)
        own = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        # The forward, not the module (``block.compile()``): hooks and checkpointing stay out.
        own.forward = torch.compile(own.forward)  # type: ignore[method-assign]


def _wait_in_flight(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with each tensor still in flight waited for: ``clone`` waits, and its gradient
    flows back to the collective's backward as eager autograd expects."""
    return tuple(arg.clone() if isinstance(arg, AsyncCollectiveTensor) else arg for arg in args)
