"""Which steps save and which take an in-memory checkpoint, by their intervals: the one rule,
asked by the trainer (``Checkpointer.decide``, the step's hooks) and by ``goodput chaos``, which
places each save fault on a periodic save and each snapshot fault on a snapshot step.

Besides these, a run saves by minutes (``[checkpoint] interval_minutes``), at its last step when
it saves at all, and on SIGTERM (``Checkpointer.decide``), and it takes an in-memory checkpoint at
every disk save too (``StepHooks.snapshot``): those depend on the clock and the signal, which no
plan drawn beforehand can know. Standard library only: chaos plans on a login node."""

from __future__ import annotations


def periodic_save(step: int, interval_steps: int) -> bool:
    """Whether ``step`` is a save by steps (``[checkpoint] interval_steps``; 0: none)."""
    return interval_steps > 0 and step % interval_steps == 0


def snapshot_step(step: int, memory_interval_steps: int) -> bool:
    """Whether ``step`` takes an in-memory checkpoint by its interval (``[checkpoint]
    memory_interval_steps``; 0: none)."""
    return memory_interval_steps > 0 and step % memory_interval_steps == 0
