"""``[optim] lr_scaling``: the learning rate scaled for a global batch other than the one it was
tuned at, with the reference batch kept in every checkpoint so a resumed run scales as the
straight one did (``train_state.json``'s ``lr_reference_tokens``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from goodput.train.config.run import RunConfig


class LrScale:
    """``[optim] lr_scaling`` against the global batch the LR was tuned at: the reference is
    ``lr_reference_tokens``, else the global batch the run began with (kept in its checkpoints:
    ``load_state_dict``), else this run's."""

    def __init__(self, cfg: RunConfig) -> None:
        self.optim = cfg.optim
        self.tokens_per_step = cfg.train.tokens_per_step
        self._set(saved=self.tokens_per_step)

    def _set(self, saved: int) -> None:
        self.factor = self.optim.lr_multiplier(self.tokens_per_step, saved)
        self.reference_tokens = self.optim.lr_reference_tokens or saved

    def describe(self) -> str | None:
        if self.factor == 1.0:
            return None
        return (
            f"train: lr x {self.factor:.4g} ({self.optim.lr_scaling} rule: global batch "
            f"{self.tokens_per_step:,} tokens, the lr was tuned at {self.reference_tokens:,})"
        )

    def state_dict(self) -> dict[str, int]:
        return {"lr_reference_tokens": self.reference_tokens}

    def load_state_dict(self, train_state: Mapping[str, Any]) -> None:
        # Checked as data with the rest of the train state (checkpoint.load.check_train_state).
        self._set(saved=train_state.get("lr_reference_tokens", self.tokens_per_step))
