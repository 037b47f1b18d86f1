"""The eval gate: the alarm for a run whose loss falls while it learns nothing anyone measures.

The seed's failure: pure-bf16 weights, RMSNorm gains whose updates rounded away, a training loss
that kept falling and ARC-Easy at chance for 17,000 steps. ``EvalGate.observe`` raises the
alarm at a step when either

* the bf16 freeze check (``train.freeze``) found tensors whose updates round away, or
* at ``alarm_evals`` in-loop evals in a row, every multiple-choice task's accuracy was within
  noise of its chance line — ``acc <= chance + 2·stderr`` — while the training loss fell over
  the interval before the eval (the mean of its second half below the mean of its first).

An eval where a task is above chance, or where the loss did not fall, resets the count: a run
whose loss is flat is broken in another way (the loss-spike and non-finite guards watch that).
The alarm is a ``warning: eval gate:`` line (rank 0), ``eval_alarm = 1`` in the step's metrics
and, with ``[eval] stop_on_alarm``, a stop with exit code 3 (``ExitCode.NOT_LEARNING``), after
which ``goodput launch --auto-retry`` and job chains do not go on. The count is part of every
checkpoint (``state_dict``), so a resumed run alarms as a straight one would.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from goodput.errors import ExitCode, GoodputError
from goodput.eval.harness import ChoiceScores

NOISE_Z = 2.0  # standard errors above chance still counted as chance
MAX_COUNT = 1 << 30  # a count in a checkpoint past this is damage, not history


def at_chance(scores: ChoiceScores) -> bool:
    """Accuracy within ``NOISE_Z`` standard errors of the chance line (one item: no noise
    estimate, so at chance unless right)."""
    stderr = scores.acc_stderr if math.isfinite(scores.acc_stderr) else 0.0
    return scores.acc <= scores.chance + NOISE_Z * stderr


@dataclass(slots=True)
class EvalGate:
    alarm_evals: int  # [eval] alarm_evals
    stop_on_alarm: bool  # [eval] stop_on_alarm
    at_chance_in_a_row: int = 0
    losses: list[float] = field(default_factory=list)  # the training losses since the last eval

    def observe(
        self,
        step: int,
        loss: float,
        *,
        frozen: Sequence[str] = (),
        tasks: Mapping[str, ChoiceScores] | None = None,
    ) -> str | None:
        """Take step ``step``'s training loss, the tensors the freeze check found frozen at it
        and, on an eval step, the tasks' scores; the alarm's line, or None."""
        if math.isfinite(loss):
            self.losses.append(loss)
        reasons = []
        if frozen:
            reasons.append(
                f"the bf16 freeze check found {len(frozen)} tensor(s) not training "
                f"({', '.join(frozen[:4])}{', ...' if len(frozen) > 4 else ''})"
            )
        if tasks:
            falling = _falling(self.losses)
            if falling is not None and all(at_chance(s) for s in tasks.values()):
                self.at_chance_in_a_row += 1
            else:
                self.at_chance_in_a_row = 0
            self.losses = []
            if self.at_chance_in_a_row >= self.alarm_evals:
                shown = ", ".join(
                    f"{name} {s.acc:.3f} (chance {s.chance:.3f})" for name, s in tasks.items()
                )
                first, last = falling or (math.nan, math.nan)
                reasons.append(
                    f"every task at chance for {self.at_chance_in_a_row} evals in a row "
                    f"({shown}) while the training loss fell ({first:.4f} -> {last:.4f})"
                )
        if not reasons:
            return None
        return (
            f"warning: eval gate: step {step}: the run is not learning what the evals measure: "
            f"{'; '.join(reasons)}; fix: check the weights' precision ([parallel] precision = "
            '"bf16_fp32_master" keeps fp32 master weights), the data and the loss reduction '
            "(goodput diagnose smoke), then resume from a checkpoint before it"
        )

    def stop_error(self, step: int) -> GoodputError:
        return GoodputError(
            "train",
            f"stopped at step {step} by the eval gate ([eval] stop_on_alarm)",
            "read the warning above; fix the run, then resume from a checkpoint before it",
            code=ExitCode.NOT_LEARNING,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"eval_gate": {"at_chance_in_a_row": self.at_chance_in_a_row}}

    def load_state_dict(self, train_state: Mapping[str, Any]) -> None:
        """The count of a checkpoint's train state (none before the gate existed); refuse what
        ``state_dict`` does not write with a ``ValueError``: a checkpoint is outside input."""
        if "eval_gate" not in train_state:
            return
        state = train_state["eval_gate"]
        count = state.get("at_chance_in_a_row") if isinstance(state, dict) else None
        if (
            not isinstance(state, dict)
            or set(state) != {"at_chance_in_a_row"}
            or type(count) is not int
            or not 0 <= count <= MAX_COUNT
        ):
            raise ValueError("eval_gate is not {'at_chance_in_a_row': a count}")
        self.at_chance_in_a_row = count


def _falling(losses: list[float]) -> tuple[float, float] | None:
    """(mean of the first half, mean of the second half) of ``losses`` when the second is
    lower; None when it is not, or there are too few to tell."""
    if len(losses) < 2:
        return None
    half = len(losses) // 2
    first = sum(losses[:half]) / half
    second = sum(losses[half:]) / (len(losses) - half)
    return (first, second) if second < first else None
