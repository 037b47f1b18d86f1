"""The precision policies that ``[parallel] precision`` names: per policy, the dtypes the trainer
uses and the bytes per parameter the planner and ``goodput model info`` count. The one table:
``parallelize`` maps its dtype names to torch's, ``goodput.plan`` reads its bytes.

- ``fp32-master`` (default): fp32 weights and optimizer state, bf16 compute, fp32 gradient
  reduction; the bf16 copies of the weights come from FSDP's mixed-precision policy
  (``mixed``), so it needs FSDP.
- ``pure-bf16``: weights, gradients and optimizer state all bf16 — half the memory, and the
  policy under which small updates can round to zero (the diagnostics need it to reproduce that).
- ``fp32``: everything fp32 (CPU tests compare it with one process).

Dtypes are named as torch names them (``float32``, ``bfloat16``), so nothing here imports torch.
Bytes held per parameter through training (``bytes_per_parameter``): the weights, their
gradients (in the weights' dtype) and AdamW's two moments (in the weights' dtype too); the bf16
working copies of fp32-master's weights are transient and not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
ADAMW_MOMENTS = 2  # the optimizer state the planner counts per parameter: AdamW's m and v


@dataclass(frozen=True, slots=True, kw_only=True)
class PrecisionPolicy:
    weights: str  # the dtype of the parameters, their gradients and the optimizer state
    compute: str  # the dtype the matmuls run in
    reduce: str  # the dtype FSDP reduces gradients in

    @property
    def mixed(self) -> bool:
        """Whether the matmuls run in another dtype than the weights: FSDP's mixed-precision
        policy casts them (``parallelize``), so the policy needs FSDP, even on one rank."""
        return self.compute != self.weights

    @property
    def parameter_bytes(self) -> int:
        return DTYPE_BYTES[self.weights]

    @property
    def gradient_bytes(self) -> int:
        """A gradient as the optimizer reads it (FSDP's sharded one: the weights' dtype)."""
        return DTYPE_BYTES[self.weights]

    @property
    def optimizer_state_bytes(self) -> int:
        return ADAMW_MOMENTS * DTYPE_BYTES[self.weights]

    @property
    def bytes_per_parameter(self) -> int:
        """Weights, gradients and optimizer state: fp32-master 16, pure-bf16 8, fp32 16."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute]

    @property
    def reduce_bytes(self) -> int:
        """A gradient as FSDP reduces it (and holds it unsharded across an accumulation)."""
        return DTYPE_BYTES[self.reduce]


# In the order ParallelConfig.precision and goodput plan's --precision list them (a test holds
# the three equal).
PRECISIONS = {
    "fp32-master": PrecisionPolicy(weights="float32", compute="bfloat16", reduce="float32"),
    "pure-bf16": PrecisionPolicy(weights="bfloat16", compute="bfloat16", reduce="bfloat16"),
    "fp32": PrecisionPolicy(weights="float32", compute="float32", reduce="float32"),
}
