"""``[eval]``: what the training loop evaluates, how often, and when its gate raises the alarm.

Every ``interval_steps`` steps (and after the last one) all ranks evaluate the blend's held-out
samples of every corpus (``holdout_samples`` per corpus, held out when the blend is built) and
the multiple-choice ``tasks``, through the training step's loss (``goodput.eval.heldout``); the
gate (``goodput.eval.gate``) raises the alarm when every task sits at chance for
``alarm_evals`` evals in a row while the training loss falls, or when the bf16 freeze check
fires, and stops the run when ``stop_on_alarm``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from goodput.config import limits
from goodput.data.blend import MAX_HELDOUT
from goodput.errors import GoodputError
from goodput.eval.choice_tasks import LAYOUTS


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """One multiple-choice task of ``[eval] tasks``: its name, JSONL layout and file."""

    name: str  # the file's stem: what metrics and evals.jsonl call it
    layout: str  # a key of choice_tasks.LAYOUTS
    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalConfig:
    # steps between in-loop evals (and one after the last step); 0: none
    interval_steps: int = field(default=0, metadata=limits(at_least=0))
    # samples of every corpus the blend leaves out of training: the held-out loss's set
    holdout_samples: int = field(default=0, metadata=limits(at_least=0, at_most=MAX_HELDOUT))
    # multiple-choice tasks as "LAYOUT:PATH" (layouts arc, hellaswag, piqa; docs/evals.md)
    tasks: tuple[str, ...] = ()
    task_items: int = field(default=200, metadata=limits(at_least=1))  # first N items of each
    # the gate: evals in a row with every task at chance while the training loss falls
    alarm_evals: int = field(default=3, metadata=limits(at_least=1))
    stop_on_alarm: bool = False  # stop the run when the gate raises the alarm (exit code 3)

    def __post_init__(self) -> None:
        self.task_specs()  # each task parses
        if self.interval_steps and not (self.holdout_samples or self.tasks):
            raise GoodputError.usage(
                "[eval]",
                "interval_steps is set but there is nothing to evaluate",
                "set holdout_samples (per corpus) or tasks, or interval_steps = 0",
            )
        if (self.tasks or self.stop_on_alarm) and not self.interval_steps:
            raise GoodputError.usage(
                "[eval]",
                "tasks and stop_on_alarm need in-loop evals",
                "set interval_steps, e.g. interval_steps = 1000",
            )

    def inert_keys(self) -> dict[str, str]:
        """What does nothing without multiple-choice tasks (config.py refuses it when set)."""
        return {} if self.tasks else dict.fromkeys(("task_items", "alarm_evals"), "tasks")

    def task_specs(self) -> list[TaskSpec]:
        specs: list[TaskSpec] = []
        for index, task in enumerate(self.tasks):
            layout, colon, path = task.partition(":")
            where = f"[eval] tasks[{index}]"
            if not colon or not path or layout not in LAYOUTS:
                raise GoodputError.usage(
                    where,
                    f"{task[:200]!r} is not LAYOUT:PATH",
                    f'write e.g. "arc:data/arc_easy.jsonl" (layouts: {", ".join(LAYOUTS)})',
                )
            name = path.rsplit("/", 1)[-1].removesuffix(".jsonl")
            if any(spec.name == name for spec in specs):
                raise GoodputError.usage(
                    where, f"a second task named {name!r}", "give every task file its own name"
                )
            specs.append(TaskSpec(name, layout, path))
        return specs
