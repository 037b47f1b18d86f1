"""The in-loop diagnostics (``[diagnostics]``), each cheap, reported through one record.

- ``gns``: the gradient noise scale B_simple in tokens (``noise_scale.py``), from each rank's own
  gradient against the summed one (``grad_tally.py``), where the layout lets it be measured.
- ``loss_z``: the loss's robust z-score against its recent window, and a ``warning: loss
  spike:`` line past ``[diagnostics] loss_spike_z`` (``loss_spikes.py``).
- ``frozen_fraction``: on every ``freeze_check_interval``-th step, the share of weight entries
  whose update rounded away, and a ``warning: bf16 freeze:`` line naming the tensors
  (``freeze.py``).
- ``max_attention_logit``: with ``[optim] qk_clip``, the step's largest attention logit, before
  the clip (``optim/qk_clip.py`` measures it and clips; this records it).
- ``sophia_unclipped``: SophiaG's share of coordinates its clip left alone (its "win rate").

The diagnostics observe and never change the step. Their running state (the noise-scale
averages, the loss window) goes into every checkpoint (``train_state.json``'s ``diagnostics``),
so a resumed run reports what a straight one does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from goodput.progress import print_line
from goodput.train.config.run import BatchPlan, DiagnosticsConfig, RunConfig
from goodput.train.monitor.freeze import FreezeDetector, FreezeReport
from goodput.train.monitor.loss_spikes import LossSpikes
from goodput.train.monitor.noise_scale import NoiseScale
from goodput.train.optim.optimizers import Optimizers
from goodput.train.optim.sophia import SophiaG
from goodput.train.parallel import grad_tally
from goodput.train.parallel.grad_tally import GradientTally
from goodput.train.parallel.mesh import ParallelMesh
from goodput.train.step import StepResult


def measures_noise(cfg: RunConfig, mesh: ParallelMesh, plan: BatchPlan) -> bool:
    """Whether this layout lets each rank's own gradient be measured (``grad_tally``)."""
    return grad_tally.measurable(
        mesh.degrees, mesh.dp_size, plan.grad_accumulation, cfg.parallel.sync_every_micro_batch
    )


class RunningDiagnostics:
    """The diagnostics' running state, part of every checkpoint: the noise-scale averages and
    the loss window."""

    def __init__(self, cfg: DiagnosticsConfig) -> None:
        self.noise = NoiseScale(cfg.gns_ema)
        self.spikes = LossSpikes(cfg.loss_spike_window, cfg.loss_spike_z)

    def state_dict(self) -> dict[str, Any]:
        return {"noise_scale": self.noise.state_dict(), "loss_spikes": self.spikes.state_dict()}

    def load_state_dict(self, train_state: Mapping[str, Any]) -> None:
        """Each one saved (none before they existed); a damaged one is a ``ValueError``
        (outside input, like the rest of the train state)."""
        for name, tracker in (("noise_scale", self.noise), ("loss_spikes", self.spikes)):
            if name in train_state:
                tracker.load_state_dict(train_state[name])


@dataclass(slots=True)
class _FreezeCheck:
    """One step's freeze check, as the step's update observer (``step.UpdateObserver``)."""

    detector: FreezeDetector
    step: int
    report: FreezeReport | None = None

    def before_step(self) -> None:
        self.detector.before_step()

    def after_step(self) -> None:
        self.report = self.detector.after_step(self.step)


class Diagnostics:
    """The in-loop diagnostics of one run on this rank; only rank 0 prints."""

    def __init__(
        self,
        cfg: DiagnosticsConfig,
        parts: list[nn.Module],
        mesh: ParallelMesh,
        tally: GradientTally | None,
    ) -> None:
        """``tally``: the step's own-gradient tally, where the layout lets the noise scale be
        measured (``measures_noise``), else None."""
        self.parts, self.mesh = parts, mesh
        self.measures_noise = tally is not None
        self.loud = dist.get_rank() == 0
        self.running = RunningDiagnostics(cfg)
        named = [(name, p) for part in parts for name, p in part.named_parameters()]
        self.freeze = (
            FreezeDetector(named, cfg.freeze_check_interval, cfg.freeze_threshold)
            if cfg.freeze_check_interval
            else None
        )
        self.check: _FreezeCheck | None = None
        self.frozen: list[str] = []  # the tensors the last step's freeze check found frozen

    def describe(self) -> str:
        measured = (
            "gradient noise scale measured"
            if self.measures_noise
            else "gradient noise scale not measured (needs data parallelism alone)"
        )
        freeze = (
            f"bf16 freeze check every {self.freeze.interval} steps"
            if self.freeze is not None
            else "no freeze check"
        )
        return f"train: diagnostics: {measured}, {freeze}"

    def freeze_check(self, step: int) -> _FreezeCheck | None:
        """The observer of step ``step``'s update when a freeze check is due, else None."""
        due = self.freeze is not None and self.freeze.due(step)
        self.check = _FreezeCheck(self.freeze, step) if due and self.freeze else None
        return self.check

    def after_step(
        self, step: int, result: StepResult, optimizer: Optimizers, max_logit: float | None
    ) -> dict[str, float | int | None]:
        """The step's diagnostic values for its record (``max_logit``: the QK-clip's, when on);
        warnings printed (rank 0)."""
        values: dict[str, float | int | None] = {}
        if result.small_batch_sq_norm is not None:
            values["gns"] = self.running.noise.update(
                result.small_batch_sq_norm,
                result.num_tokens // self.mesh.dp_size,
                result.grad_norm**2,
                result.num_tokens,
            )
        z, spike = self.running.spikes.update(step, result.loss)
        values["loss_z"] = z
        warnings = [spike] if spike else []
        self.frozen = []
        if self.check is not None and self.check.report is not None:
            values["frozen_fraction"] = self.check.report.frozen_fraction
            self.frozen = list(self.check.report.frozen_tensors)
            if (line := self.check.report.warning()) is not None:
                warnings.append(line)
        if max_logit is not None:
            values["max_attention_logit"] = max_logit
        sophias = [o for o in optimizer.optimizers if isinstance(o, SophiaG)]
        if sophias and sophias[0].last_unclipped_fraction is not None:
            values["sophia_unclipped"] = sophias[0].last_unclipped_fraction
        if self.loud:
            for line in warnings:
                print_line(line)
        return values
