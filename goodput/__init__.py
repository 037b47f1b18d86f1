"""goodput: pre-train large language models on supercomputers and keep the run alive to the end.

Three parts usable alone: ``goodput.data`` (tokenize, blend, pin), ``goodput.launch`` (one launch
command, layered recovery) and ``goodput.train`` (the trainer).
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
