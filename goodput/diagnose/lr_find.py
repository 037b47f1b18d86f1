"""``goodput diagnose lr-find``: the LR range test, run by the trainer's own builders and step.

A fresh model of the config, built exactly as ``goodput train`` builds it (``setup_torch``,
``build_run``: the same mesh, batch plan, loader, model and optimizers), takes ``train_step``
steps on the config's data while the LR ramps exponentially from ``min_lr`` to ``max_lr``;
every optimizer group gets the step's LR, as the trainer sets its schedule's. It
stops at the cliff (``lr_regions``: ŝ past 4 x its best, or a loss or gradient norm that is not
finite: ``train_step`` skips such a step). One process or every rank under a launcher; rank 0
writes ``<run_dir>/lr_find.json`` (after the trainer's run-directory check) and nothing else
there. No checkpoint is saved or resumed, no metrics or TensorBoard files are written. The
curve analysis is ``lr_regions``'s, the plot ``plots``'.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from goodput import rundir
from goodput.diagnose.lr_regions import Regions, SmoothedLoss, find_regions, ramp
from goodput.errors import GoodputError
from goodput.io import write_json
from goodput.train.build import build_run
from goodput.train.config.run import RunConfig
from goodput.train.setup import setup_torch
from goodput.train.step import train_step

MIN_STEPS = 10  # fewer points cannot show three regions
MAX_STEPS = 100_000
NUM_PROGRESS_LINES = 10


@dataclass(frozen=True, slots=True)
class RampSettings:
    num_steps: int
    min_lr: float
    max_lr: float

    def __post_init__(self) -> None:
        if not MIN_STEPS <= self.num_steps <= MAX_STEPS:
            raise GoodputError.usage(
                "--steps",
                f"{self.num_steps} is not in [{MIN_STEPS}, {MAX_STEPS:,}]",
                "pass a count in that range (200 or more, so that Adam's moments keep up)",
            )
        for option, lr in (("--min-lr", self.min_lr), ("--max-lr", self.max_lr)):
            if not (math.isfinite(lr) and lr > 0):
                raise GoodputError.usage(option, f"{lr} is not a finite number > 0", "pass one")
        if self.min_lr >= self.max_lr:
            raise GoodputError.usage(
                "--min-lr",
                f"{self.min_lr:g} is not below --max-lr {self.max_lr:g}",
                "pass a --min-lr below --max-lr (e.g. 1e-7 and 10)",
            )
        if not math.isfinite(self.max_lr / self.min_lr):  # the ramp's ratio: lrs of inf
            raise GoodputError.usage(
                "--min-lr",
                f"{self.min_lr:g} is too small a start for a ramp to --max-lr {self.max_lr:g}: "
                "their ratio is past float's range",
                "pass a --min-lr near the LRs of interest (e.g. 1e-7)",
            )


@dataclass(frozen=True, slots=True)
class CurvePoint:
    step: int
    lr: float
    loss: float | None  # None: not finite
    # None: the loss or the gradient norm was not finite, or ŝ overflowed (a loss near float's
    # limit): a step at the cliff
    smoothed_loss: float | None
    grad_norm: float | None  # before clipping; None: not finite


@dataclass(frozen=True, slots=True)
class LrFindResult:
    settings: RampSettings
    curve: tuple[CurvePoint, ...]
    stopped_early: bool
    regions: Regions

    def as_json(self) -> dict[str, Any]:
        return {
            "suggested_lr": self.regions.suggested_lr,
            "regions": self.regions.as_json(),
            "note": self.regions.note,
            "steps_run": len(self.curve),
            "stopped_early": self.stopped_early,
            "curve": [
                {
                    "step": p.step,
                    "lr": p.lr,
                    "loss": p.loss,
                    "smoothed_loss": p.smoothed_loss,
                    "grad_norm": p.grad_norm,
                }
                for p in self.curve
            ],
        }

    def summary(self) -> list[str]:
        """The human lines."""

        def interval(name: str, value: tuple[float, float] | None) -> str:
            return f"{name} {'-' if value is None else f'{value[0]:.3g}..{value[1]:.3g}'}"

        r = self.regions
        stop = "stopped early at the cliff" if self.stopped_early else "ran the whole ramp"
        lines = [
            f"lr-find: {len(self.curve)}/{self.settings.num_steps} steps, {stop}",
            "lr-find: regions: "
            + ", ".join(
                [
                    interval("plateau", r.plateau),
                    interval("basin", r.basin),
                    interval("cliff", r.cliff),
                ]
            ),
            f"lr-find: suggested lr {r.suggested_lr:.3g}",
        ]
        if r.note:
            lines.append(f"lr-find: note: {r.note}")
        return lines


def lr_find(
    cfg: RunConfig, settings: RampSettings, progress: Callable[[str], None] | None = None
) -> LrFindResult | None:
    """Run the ramp on this rank; the result on rank 0 (which wrote it to the run directory),
    None on the others. ``progress``: called on rank 0 about every tenth of the steps."""
    lrs = ramp(settings.min_lr, settings.max_lr, settings.num_steps)
    # The blend is sized by train.steps: exactly the ramp's (with the data-mix stages that start
    # within it); the optimizer starts at its first LR.
    cfg = cfg.shortened(settings.num_steps)
    cfg = replace(cfg, schedule=replace(cfg.schedule, lr=lrs[0]))
    owns_process_group = not dist.is_initialized()
    runtime = setup_torch(seed=cfg.train.seed)
    try:
        run = build_run(cfg, runtime, trains=False)
        curve = Curve()
        batches = iter(run.loader)
        every = max(1, settings.num_steps // NUM_PROGRESS_LINES)
        for index, lr in enumerate(lrs):
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            result = train_step(
                run.model,
                run.optimizer,
                run.micro_batches(next(batches)),
                run.step_settings,
                hessian_labels=run.hessian_labels(index + 1),
            )
            # The loss and norm are the same on every rank, so every rank stops at one step.
            at_cliff = curve.add(lr, result.loss, result.grad_norm, skipped=result.skipped)
            if progress is not None and runtime.rank == 0 and (index + 1) % every == 0:
                progress(_progress_line(curve.points[-1], settings.num_steps))
            if at_cliff:
                break
        if runtime.rank != 0:
            return None
        found = curve.result(settings)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        ramp_settings = {
            "steps": settings.num_steps,
            "min_lr": settings.min_lr,
            "max_lr": settings.max_lr,
        }
        write_json(run.run_dir / rundir.LR_FIND, {**found.as_json(), "ramp": ramp_settings})
        return found
    finally:
        if owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


class Curve:
    """The ramp's points as its steps come, and the stop rule; ``result`` reads the regions.

    Every number it keeps is finite or None, so the result is strict JSON on any losses.
    """

    def __init__(self) -> None:
        self.points: list[CurvePoint] = []
        self._average = SmoothedLoss()

    def add(self, lr: float, loss: float, grad_norm: float, *, skipped: bool) -> bool:
        """Record the next step; True when the ramp stops at it (the cliff): a loss or gradient
        norm that is not finite (``train_step`` skipped the step), or ŝ diverged."""
        finite = math.isfinite(loss) and not skipped
        smoothed = _finite(self._average.add(loss)) if finite else None
        self.points.append(
            CurvePoint(len(self.points) + 1, lr, _finite(loss), smoothed, _finite(grad_norm))
        )
        return smoothed is None or self._average.diverged(smoothed)

    def result(self, settings: RampSettings) -> LrFindResult:
        stopped_early = len(self.points) < settings.num_steps
        regions = find_regions(
            [p.lr for p in self.points], [p.smoothed_loss for p in self.points], stopped_early
        )
        return LrFindResult(settings, tuple(self.points), stopped_early, regions)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _progress_line(point: CurvePoint, num_steps: int) -> str:
    loss = "not finite" if point.loss is None else f"{point.loss:.4f}"
    smoothed = "-" if point.smoothed_loss is None else f"{point.smoothed_loss:.4f}"
    return (
        f"lr-find: step {point.step}/{num_steps} lr {point.lr:.3g} loss {loss} "
        f"(smoothed {smoothed})"
    )
