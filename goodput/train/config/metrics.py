"""The ``[metrics]`` table: where the step records go besides ``metrics.jsonl`` and TensorBoard.

Weights & Biases is an optional sink: with ``wandb = true`` rank 0 logs every record's numeric
values (the keys TensorBoard gets, ``train/<key>``) at the record's step (``metrics.Metrics``).
Offline by default, since compute nodes have no network: the run is written to
``<wandb_dir>/wandb/offline-run-*`` (``wandb_dir`` is wandb's own ``dir``; by default the run
directory, so ``RUN/wandb/``) and uploaded later with ``wandb sync``. Each trainer process (each
attempt of a run) is one wandb run, grouped by the run directory's name, so a step run again
after a restart never goes back in time inside one wandb run. ``check_sinks`` refuses a sink
that cannot work here before the run writes anything. No torch: ``goodput plan`` reads this.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Literal

from goodput.config import NON_EMPTY
from goodput.errors import GoodputError

WANDB_KEYS = ("wandb_project", "wandb_mode", "wandb_dir")


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsConfig:
    wandb: bool = False  # also log every step record to Weights & Biases (pip install wandb)
    wandb_project: str = field(default="goodput", metadata=NON_EMPTY)
    wandb_mode: Literal["online", "offline"] = "offline"  # offline: `wandb sync` uploads later
    # wandb's dir: runs go to <wandb_dir>/wandb/; None: the run directory (RUN/wandb/)
    wandb_dir: str | None = field(default=None, metadata=NON_EMPTY)

    def inert_keys(self) -> dict[str, str]:
        """The sink's options, which do nothing with it off (config.py refuses them when set)."""
        return {} if self.wandb else dict.fromkeys(WANDB_KEYS, "wandb = true")

    def check_sinks(self) -> None:
        """Refuse a sink asked for that is not installed; called before the run writes
        anything (and on rank 0, the only rank that logs)."""
        if not self.wandb:
            return
        try:
            importlib.import_module("wandb")
        except ImportError:
            raise GoodputError(
                "[metrics] wandb",
                "is true but wandb is not installed",
                "pip install wandb, or set [metrics] wandb = false",
            ) from None
