"""This rank's squared gradient norm before the data-parallel sum: the small batch of the
gradient noise scale's two-batch estimate (``noise_scale.py``), measured at no extra pass.

Under FSDP every unit reduce-scatters one flat buffer of its unreduced gradients: our
reduce-scatter (``collectives.CountedReduceScatter``) adds up the squares of that buffer on its
way in — the gradient of this rank's own tokens, padding zeros included harmlessly — then does
the default reduce-scatter. Without FSDP the step squares the gradients itself before its
all-reduce. Either way the all-reduced gradient's norm, which the clip computes anyway, is the
big batch.

Measured only where a rank's gradient is its own tokens' loss gradient, whole (``measurable``):
not under tensor, context, expert or pipeline parallelism (they split the model or mix ranks'
tokens inside the backward), and with one reduction per step (not ``sync_every_micro_batch``
with accumulation, which would tally each micro-batch's gradient apart).
"""

from __future__ import annotations

import torch

from goodput.train.config.parallel import Degrees


def measurable(degrees: Degrees, dp_size: int, accumulation: int, sync_every: bool) -> bool:
    return (
        dp_size > 1
        and degrees.tp == degrees.cp == degrees.ep == degrees.pp == 1
        and not (sync_every and accumulation > 1)
    )


class GradientTally:
    """The running sum of squares of this rank's unreduced gradients during one step."""

    def __init__(self) -> None:
        self.squared: torch.Tensor | None = None

    def add(self, gradients: torch.Tensor) -> None:
        # One pass, no temporary: a norm accumulated in fp32 whatever the gradients' dtype.
        squares = torch.linalg.vector_norm(gradients, dtype=torch.float32).square()
        self.squared = squares if self.squared is None else self.squared + squares

    def take(self) -> torch.Tensor | None:
        """The step's sum (None: nothing was reduced), and start the next step's."""
        squared, self.squared = self.squared, None
        return squared
