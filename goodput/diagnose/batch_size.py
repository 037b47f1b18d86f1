"""``goodput diagnose batch-size``: the run's gradient noise scale against its global batch.

The trainer writes, per step, ``"gns"`` to ``RUN_DIR/metrics.jsonl``: the smoothed estimate of
B_simple = tr(Σ)/|G|² in tokens (optim.md section 10), null or absent where it is not yet
available or the layout cannot measure it. With B the configured global batch
(``[train] tokens_per_step`` of ``RUN_DIR/config.toml``) and B_noise ≈ B_simple, McCandlish et
al. 2018 give the steps and the data a target loss costs against their minima:
S/S_min = 1 + B_noise/B and E/E_min = 1 + B/B_noise. This module reports B_simple over the run
and those two factors, as efficiencies S_min/S = B/(B + B_noise) and E_min/E = B_noise/(B +
B_noise) (they add up to 1; both are 1/2 at the critical batch B = B_noise).

Both files come from outside (a live run, a copied folder) and are read strictly and in bounds,
the metrics by their schema's reader (``runfiles.read_steps``: a line is a JSON object with a
whole ``step`` and a ``gns`` that is a number or null; a broken line is one error naming the
file and line, except a torn last line, no newline yet: a live run is writing it, which is
skipped). A gns outside [2**-53, 2**53] tokens (not finite, not > 0, or an estimator
that divided by a near-zero |G|² or tr(Σ)) is ignored and counted, so that every figure of the
report is a finite number and its JSON strict. A step logged
twice (a resumed run repeats steps after its checkpoint) keeps its later line. Standard library
only: no torch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput import rundir, runfiles
from goodput.config import MAX_NUMBER
from goodput.errors import ExitCode, GoodputError
from goodput.io import is_folder

NUM_WINDOWS = 8
# A usable B_simple, in tokens: 2**53 is the largest global batch a config admits; a larger
# estimate, or one below its inverse, is the estimator dividing by a near-zero |G|² or tr(Σ),
# not a batch. Within these bounds B/B_simple, its inverse and the range stay finite.
MIN_GNS_TOKENS = 2.0**-53
MAX_GNS_TOKENS = float(MAX_NUMBER)
UNUSABLE = "not a number in [2**-53, 2**53]"
# The recommended range: within a factor 2 of the critical batch B_crit ≈ B_noise, where neither
# the steps nor the data cost more than 3x their minimum (2x each at B_crit itself).
RECOMMENDED_BELOW = 0.5
RECOMMENDED_ABOVE = 2.0


@dataclass(frozen=True, slots=True)
class Estimates:
    """The usable gns per step, in step order, and what was left out."""

    by_step: dict[int, float]
    num_lines: int  # step lines read
    num_ignored: int  # gns present but outside [MIN_GNS_TOKENS, MAX_GNS_TOKENS]


@dataclass(frozen=True, slots=True)
class Window:
    first_step: int
    last_step: int
    median_gns: float
    num_estimates: int


@dataclass(frozen=True, slots=True)
class BatchSizeReport:
    first: float
    median_last_quarter: float
    last: float
    global_batch_tokens: int
    windows: tuple[Window, ...]
    steps_with_estimate: int
    ignored_estimates: int

    @property
    def ratio(self) -> float:
        """B / B_simple: below 1 the batch is under the critical batch."""
        return self.global_batch_tokens / self.median_last_quarter

    @property
    def step_efficiency(self) -> float:
        """S_min / S = 1 / (1 + B_noise/B): the fraction of the steps that was necessary."""
        return 1 / (1 + 1 / self.ratio)

    @property
    def data_efficiency(self) -> float:
        """E_min / E = 1 / (1 + B/B_noise): the fraction of the tokens that was necessary."""
        return 1 / (1 + self.ratio)

    @property
    def recommended_tokens(self) -> tuple[float, float]:
        b_noise = self.median_last_quarter
        return RECOMMENDED_BELOW * b_noise, RECOMMENDED_ABOVE * b_noise

    def as_json(self) -> dict[str, Any]:
        return {
            "b_simple_tokens": {
                "first": self.first,
                "median_last_quarter": self.median_last_quarter,
                "last": self.last,
            },
            "global_batch_tokens": self.global_batch_tokens,
            "ratio": self.ratio,
            "step_efficiency": self.step_efficiency,
            "data_efficiency": self.data_efficiency,
            "recommended_tokens": list(self.recommended_tokens),
            "verdict": self.verdict(),
            "windows": [
                {
                    "first_step": w.first_step,
                    "last_step": w.last_step,
                    "median_gns": w.median_gns,
                    "num_estimates": w.num_estimates,
                }
                for w in self.windows
            ],
            "steps_with_estimate": self.steps_with_estimate,
            "ignored_estimates": self.ignored_estimates,
        }

    def verdict(self) -> str:
        """What the ratio implies for the global batch, in one sentence."""
        b, b_noise = self.global_batch_tokens, self.median_last_quarter
        if self.ratio < RECOMMENDED_BELOW:
            return (
                f"the global batch ({b:,} tokens) is well below the noise scale: more data "
                "parallelism (a larger global batch, LR rescaled) speeds training up near-"
                f"linearly; up to about {RECOMMENDED_ABOVE * b_noise:,.0f} tokens is still a "
                "good trade"
            )
        if self.ratio > RECOMMENDED_ABOVE:
            # Steps at B over steps at 2B: what one more doubling would buy.
            gain = (1 + b_noise / b) / (1 + b_noise / (2 * b))
            return (
                f"the global batch ({b:,} tokens) is well above the noise scale: diminishing "
                f"returns, a doubling would cut the steps only {gain:.2f}x while the tokens "
                f"spent are already {1 + self.ratio:.2f}x the minimum; a smaller global batch "
                "(or a batch-size ramp) spends the data better"
            )
        return (
            f"the global batch ({b:,} tokens) is near the critical batch: a good trade between "
            "steps and data"
        )

    def lines(self) -> list[str]:
        """The human report."""
        low, high = self.recommended_tokens
        out = [
            f"batch-size: B_simple (tokens): first {self.first:,.0f}, median of the last "
            f"quarter {self.median_last_quarter:,.0f}, last {self.last:,.0f} "
            f"({self.steps_with_estimate} steps with an estimate"
            + (f", {self.ignored_estimates} ignored: {UNUSABLE}" if self.ignored_estimates else "")
            + ")",
            f"{'steps':>17}  {'median gns':>14}  {'estimates':>9}",
        ]
        out += [
            f"{f'{w.first_step}-{w.last_step}':>17}  {w.median_gns:>14,.0f}  {w.num_estimates:>9}"
            for w in self.windows
        ]
        out += [
            f"batch-size: global batch B = {self.global_batch_tokens:,} tokens, B/B_simple = "
            f"{self.ratio:.3g}: steps {1 + 1 / self.ratio:.2f}x their minimum (step efficiency "
            f"{self.step_efficiency:.0%}), tokens {1 + self.ratio:.2f}x their minimum (data "
            f"efficiency {self.data_efficiency:.0%})",
            f"batch-size: {self.verdict()}",
            f"batch-size: recommended global batch {low:,.0f}-{high:,.0f} tokens (B_simple/2 to "
            "2 B_simple, around the critical batch)",
        ]
        return out


def report(run_dir: Path) -> BatchSizeReport:
    """Read ``run_dir``'s config and metrics; the report, or a one-line ``GoodputError``."""
    if not is_folder(run_dir):  # a loop of links is named as one
        raise GoodputError.usage(run_dir, "is not a folder", "pass a run directory (train.run_dir)")
    global_batch = runfiles.read_tokens_per_step(run_dir / rundir.CONFIG)
    metrics = run_dir / rundir.METRICS
    estimates = read_estimates(metrics)
    if not estimates.by_step:
        raise no_estimate_error(metrics, estimates)
    return summarise(estimates, global_batch)


def read_estimates(path: Path) -> Estimates:
    """Every step's usable gns from the metrics file ``path`` (``runfiles.read_steps``)."""
    by_step: dict[int, float] = {}
    num_lines = num_ignored = 0
    try:
        for line in runfiles.read_steps(path, fix=_FIX):
            num_lines += 1
            gns = line.number("gns")
            if gns is None:
                by_step.pop(line.step, None)  # a repeated step without one: no estimate now
            elif MIN_GNS_TOKENS <= gns <= MAX_GNS_TOKENS:  # False for NaN
                by_step[line.step] = gns
            else:
                num_ignored += 1
                by_step.pop(line.step, None)
    except GoodputError as exc:  # a broken metrics file is bad input to this command
        raise GoodputError.usage(exc.where, exc.what, exc.fix) from None
    return Estimates(dict(sorted(by_step.items())), num_lines, num_ignored)


def summarise(estimates: Estimates, global_batch_tokens: int) -> BatchSizeReport:
    """The report of a non-empty set of estimates."""
    steps = list(estimates.by_step)
    values = list(estimates.by_step.values())
    assert values
    last_quarter = values[-math.ceil(len(values) / 4) :]
    return BatchSizeReport(
        first=values[0],
        median_last_quarter=statistics.median(last_quarter),
        last=values[-1],
        global_batch_tokens=global_batch_tokens,
        windows=windows(steps, values),
        steps_with_estimate=len(values),
        ignored_estimates=estimates.num_ignored,
    )


def windows(steps: list[int], values: list[float], count: int = NUM_WINDOWS) -> tuple[Window, ...]:
    """``count`` (or fewer) consecutive windows of about equal numbers of estimates."""
    count = min(count, len(values))
    bounds = [round(i * len(values) / count) for i in range(count + 1)]
    return tuple(
        Window(steps[lo], steps[hi - 1], statistics.median(values[lo:hi]), hi - lo)
        for lo, hi in zip(bounds, bounds[1:], strict=False)
    )


def no_estimate_error(metrics: Path, estimates: Estimates) -> GoodputError:
    ignored = (
        f", and {estimates.num_ignored} unusable ({UNUSABLE})" if estimates.num_ignored else ""
    )
    return GoodputError(
        metrics,
        f"the run has no gradient-noise-scale estimate: none of its {estimates.num_lines} step "
        f'lines has a usable "gns"{ignored}. It is measured by comparing the gradients of '
        "data-parallel ranks, so a run with a single data-parallel rank has none, nor does a "
        "layout that cannot measure it, and the first steps have none while it warms up",
        "train with 2 or more data-parallel ranks (e.g. goodput launch --nproc 2) for a few "
        "hundred steps, then rerun",
        code=ExitCode.ERROR,
    )


_FIX = "restore the file, or delete the broken line"
