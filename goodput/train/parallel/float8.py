"""FP8 training (``[parallel] fp8``): the blocks' linear layers multiply in float8 through torchao's
float8 training, applied by ``parallelize`` first of all, before the tensor split, checkpointing,
compile and FSDP (torchtitan's order: each of those wraps the converted layers).

What is converted: every ``nn.Linear`` inside a block (attention's ``wq``/``wk``/``wv``/``wo``, the
SwiGLU's ``w1``/``w3``/``w2``, an MoE layer's shared expert), each replaced by torchao's
``Float8Linear``, which casts its input, weight and output gradient to float8 with dynamic
scales (``"tensorwise"``: one scale per tensor; ``"rowwise"``: one per row, rounded to a power of
two) and multiplies in FP8. Not converted: the embedding and the output head (torchtitan keeps
them high-precision too: the logits are the most sensitive matmul), an MoE layer's router (its
scores pick the experts) and its grouped experts (not ``nn.Linear``; they stay in the precision
policy's dtype). The weights themselves are not touched: they stay in the policy's dtype (fp32
master weights under ``fp32-master``), so a checkpoint holds the same keys and dtypes with fp8 on
or off and loads across.

With FSDP and ``"tensorwise"``, FSDP gathers the weights in float8 (half of bf16's bytes);
``precompute_weight_scales``, after each optimizer step, then computes every weight's scale in
one all-reduce rather than one per weight per gather. torchao gathers only tensorwise-scaled
weights in float8 (a row's scale needs the whole row): ``"rowwise"`` gathers in the policy's
dtype. Under tensor parallelism the plan's styles stay torch's own: a ``Float8Linear`` is split
like the ``nn.Linear`` it replaced, and casts its local shard.

Refused, in ``check`` before converting: a device without FP8 matmuls
(``device.fp8_matmuls_missing``) unless ``fp8_emulate``; torchao missing. ``ParallelConfig``
refuses what needs no torch (a layer dimension that is no multiple of 16 per rank). Nothing else
is: pipeline, context and expert parallelism, activation checkpointing and compile compose with
the converted layers as they are (checked on CPU, emulated).

torchao's import logs a warning for each of its CUDA extensions it cannot load (every CPU host)
and torch a deprecation of one of torchao's registrations: neither concerns the run, so both
lines are filtered while torchao is imported (``_quiet_import``), nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from goodput.errors import GoodputError
from goodput.train.config.parallel import ParallelConfig
from goodput.train.device import fp8_matmuls_missing

# Set on a model whose FSDP gathers float8 weights: ``precompute_weight_scales`` looks for it.
GATHERS_FLOAT8 = "goodput_gathers_float8"
# torchao's import-time lines that say nothing about a run, by logger (see the module docstring).
_IMPORT_NOISE = {
    "torchao": "Failed to load ",
    "torch.utils._pytree": "is an Enum subclass and is now natively supported",
}


def check(cfg: ParallelConfig, device_type: str) -> None:
    """Refuse ``cfg.fp8`` on this rank's ``device_type`` (its current device) in one line: no FP8
    matmuls there unless emulated; torchao not installed."""
    assert cfg.fp8 is not None
    if not cfg.fp8_emulate:
        missing = fp8_matmuls_missing(device_type)
        if missing is not None:
            raise GoodputError.usage(
                "[parallel]",
                f"fp8 = '{cfg.fp8}' needs FP8 matmuls, which {missing}",
                "train without fp8 on this device, or set fp8_emulate = true (emulated FP8 is "
                "slower than bf16: for tests only)",
            )
    if importlib.util.find_spec("torchao") is None:
        raise GoodputError.usage(
            "[parallel]",
            f"fp8 = '{cfg.fp8}' trains through torchao's float8 training, which is not installed",
            "pip install goodput[fp8] (torchao), or leave fp8 unset",
        )


def convert_blocks(
    model: nn.Module, cfg: ParallelConfig, *, device_type: str, gather_float8: bool
) -> None:
    """Replace every ``nn.Linear`` in ``model``'s blocks, an MoE router aside, with torchao's
    ``Float8Linear`` for ``cfg.fp8``'s recipe (emulated with ``cfg.fp8_emulate``), in place,
    once ``check`` let it on ``device_type``. ``gather_float8``: FSDP will shard these weights;
    with ``"tensorwise"`` it then gathers them in float8, and ``model`` is marked for
    ``precompute_weight_scales``."""
    check(cfg, device_type)
    assert cfg.fp8 is not None
    with _quiet_import():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    gather_float8 = gather_float8 and cfg.fp8 == "tensorwise"
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(cfg.fp8),
        emulate=cfg.fp8_emulate,
        enable_fsdp_float8_all_gather=gather_float8,
    )
    blocks: Any = model.blocks
    for block in blocks.values():
        convert_to_float8_training(block, config=config, module_filter_fn=_not_a_router)
    if gather_float8:
        setattr(model, GATHERS_FLOAT8, True)


def precompute_weight_scales(parts: Sequence[nn.Module]) -> None:
    """After an optimizer step: the float8 scales of the weights FSDP gathers in float8, in one
    all-reduce per part (without it, each gather computes its weight's own, one all-reduce each).
    Nothing for a part that does not gather float8 (any run without fp8 = 'tensorwise' and
    FSDP)."""
    for part in parts:
        if getattr(part, GATHERS_FLOAT8, False):
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(part)


def _not_a_router(_module: nn.Module, name: str) -> bool:
    # An MoE layer's router picks the experts from its scores: kept in the policy's precision.
    return not name.endswith("router")


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    filters = []
    for logger_name, start in _IMPORT_NOISE.items():
        logger = logging.getLogger(logger_name)
        noise = _DropMessage(start)
        logger.addFilter(noise)
        filters.append((logger, noise))
    try:
        yield
    finally:
        for logger, noise in filters:
            logger.removeFilter(noise)


class _DropMessage(logging.Filter):
    """Drops the records whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()
