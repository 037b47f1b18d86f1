"""goodput: pre-train large language models on supercomputers and keep the run alive to the end.

Three main parts, each usable alone: ``goodput.data`` (tokenize, blend, pin), ``goodput.launch``
(one launch command, layered recovery) and ``goodput.train`` (the trainer; ``setup_torch``
below is its portable start). Beside them: ``goodput.checkpoint`` (saves on disk and in memory,
resume), ``goodput.eval`` (in the loop and on a checkpoint), ``goodput.plan`` (the layout and the
failure budget before a job, torch-free), ``goodput.report`` (where a run's hours went),
``goodput.diagnose`` (the smoke gate, the LR finder, the critical batch), ``goodput.chaos``
(fault campaigns that check recovery), ``goodput.commands`` with ``goodput.cli`` (the command
line) and ``goodput.testing`` (helpers for tests and benchmarks). The modules at this root are
leaves every part may import (errors, io, config reading, the run directory and its files, the
launcher's signals to the ranks, the output guard, figures, progress); they import no part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from goodput.train.setup import Runtime

__version__ = "0.1.0"


def setup_torch(seed: int = 0, timeout_s: float | None = None) -> Runtime:
    """Portable start of a run (see ``goodput.train.setup``): this rank's ``Runtime`` (rank,
    world_size, device); imports torch only when called."""
    from goodput.train.setup import DEFAULT_TIMEOUT_S
    from goodput.train.setup import setup_torch as setup

    return setup(seed, DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
