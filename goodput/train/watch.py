"""The loop's in-loop diagnostics and optimizer extras, each cheap, reported through one record.

- ``gns``: the gradient noise scale B_simple in tokens (``noise_scale.py``), from each rank's own
  gradient against the summed one (``grad_tally.py``), where the layout lets it be measured.
- ``loss_z``: the loss's robust z-score against its recent window, and a ``warning: loss
  spike:`` line past ``[diagnostics] loss_spike_z`` (``loss_spikes.py``).
- ``frozen_fraction``: on every ``freeze_check_interval``-th step, the share of weight entries
  whose update rounded away, and a ``warning: bf16 freeze:`` line naming the tensors
  (``freeze.py``).
- ``max_attention_logit``: with ``[optim] qk_clip``, the step's largest attention logit, before
  the clip (``qk_clip.py``).
- ``sophia_unclipped``: SophiaG's share of coordinates its clip left alone (its "win rate").

Also here: the LR scaling rule across runs with another global batch (``LrScale``), and the
per-step generator SophiaG's sampled labels come from. The diagnostics' running state (the
noise-scale averages, the loss window) and the LR reference go into every checkpoint, so a
resumed run reports what a straight one does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from goodput.progress import print_line
from goodput.train import grad_tally, qk_clip
from goodput.train.config import BatchPlan, DiagnosticsConfig, RunConfig
from goodput.train.freeze import FreezeDetector, FreezeReport
from goodput.train.loss_spikes import LossSpikes
from goodput.train.mesh import ParallelMesh
from goodput.train.noise_scale import NoiseScale
from goodput.train.optim import Optimizers
from goodput.train.sophia import SophiaG
from goodput.train.step import StepResult


def measures_noise(cfg: RunConfig, mesh: ParallelMesh, plan: BatchPlan) -> bool:
    """Whether this layout lets each rank's own gradient be measured (``grad_tally``)."""
    return grad_tally.measurable(
        mesh.degrees, mesh.dp_size, plan.grad_accumulation, cfg.parallel.sync_every_micro_batch
    )


def replica_group(mesh: ParallelMesh) -> dist.ProcessGroup | None:
    """The ranks holding the same plain (unsharded) parameters: those of the token group."""
    return mesh.token_group if dist.get_world_size(mesh.token_group) > 1 else None


def label_generator(
    seed: int, step: int, mesh: ParallelMesh, device: torch.device
) -> torch.Generator:
    """The generator of step ``step``'s sampled labels: its own stream per step and token-group
    rank (other tokens, other draws), the same on the tensor-parallel ranks sharing tokens, and
    the same again after a resume."""
    rank = dist.get_rank(mesh.token_group)
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + rank) % 2**63
    return torch.Generator(device=device).manual_seed(mixed)


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


class Watch:
    """The diagnostics of one run on this rank; only rank 0 prints."""

    def __init__(
        self,
        cfg: RunConfig,
        parts: list[nn.Module],
        mesh: ParallelMesh,
        *,
        measures_noise: bool,
    ) -> None:
        self.cfg, self.parts, self.mesh = cfg, parts, mesh
        self.measures_noise = measures_noise
        self.loud = dist.get_rank() == 0
        diagnostics = cfg.diagnostics
        self.running = RunningDiagnostics(diagnostics)
        named = [(name, p) for part in parts for name, p in part.named_parameters()]
        self.freeze = (
            FreezeDetector(named, diagnostics.freeze_check_interval, diagnostics.freeze_threshold)
            if diagnostics.freeze_check_interval
            else None
        )
        self.check: _FreezeCheck | None = None
        self.frozen: list[str] = []  # the tensors the last step's freeze check found frozen
        self.max_logit: float | None = None
        if cfg.optim.qk_clip is not None:
            qk_clip.track_logits(parts)

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
        clip = f", qk-clip at {self.cfg.optim.qk_clip:g}" if self.cfg.optim.qk_clip else ""
        return f"train: diagnostics: {measured}, {freeze}{clip}"

    def freeze_check(self, step: int) -> _FreezeCheck | None:
        """The observer of step ``step``'s update when a freeze check is due, else None."""
        due = self.freeze is not None and self.freeze.due(step)
        self.check = _FreezeCheck(self.freeze, step) if due and self.freeze else None
        return self.check

    def clip_logits(self) -> None:
        """QK-clip after the update, when it is on."""
        if self.cfg.optim.qk_clip is not None:
            self.max_logit = qk_clip.clip(
                self.parts, self.cfg.optim.qk_clip, self.mesh.token_group, self._tp_group()
            )

    def _tp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.tp_mesh.get_group() if self.mesh.degrees.tp > 1 else None

    def after_step(
        self, step: int, result: StepResult, optimizer: Optimizers
    ) -> dict[str, float | int | None]:
        """The step's diagnostic values for its record; warnings printed (rank 0)."""
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
        if self.max_logit is not None:
            values["max_attention_logit"] = self.max_logit
        sophias = [o for o in optimizer.optimizers if isinstance(o, SophiaG)]
        if sophias and sophias[0].last_unclipped_fraction is not None:
            values["sophia_unclipped"] = sophias[0].last_unclipped_fraction
        if self.loud:
            for line in warnings:
                print_line(line)
        return values
