"""The fault plan of a chaos campaign, drawn from a seed: which faults, at which steps, on which
ranks, and how often the run must save for them.

The same seed, count, kinds, steps, interval and ranks give the same plan. Kinds are dealt
evenly: each kind of ``kinds`` appears ``num_faults // len(kinds)`` or one more times, in an
order drawn from the seed, so that a campaign of at least as many faults as kinds tries every
kind. Steps are distinct and leave the run its last step to finish after the last fault:
  - ``ckpt-kill`` and ``save-fail`` fire in a checkpoint save, so each gets a save step of its
    own (a multiple of the interval before the last step): no two of them meet in one save, and
    a failed save is never the final one, whose checkpoint the campaign compares;
  - every other kind gets any other step in [1, steps - 1].
Ranks are drawn uniformly below ``num_ranks``. The file written is the one
``goodput.faults`` reads (its docstring has the format); ids number the faults in step
order. A plan that cannot fit (more faults than steps) is a usage error naming ``--faults``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from goodput.errors import GoodputError
from goodput.faults import IN_SAVE, Fault, parse_plan
from goodput.io import write_json

SAVES_PER_RUN = 10  # the interval chaos sets, when it must set one: steps // this


def deal_kinds(num_faults: int, kinds: Sequence[str], seed: int) -> list[str]:
    """``num_faults`` kinds from ``kinds``, as evenly as they divide, in a drawn order."""
    rng = random.Random(f"goodput chaos kinds {seed}")
    order = list(kinds)
    rng.shuffle(order)
    dealt = [order[i % len(order)] for i in range(num_faults)]
    rng.shuffle(dealt)
    return dealt


def save_steps(num_steps: int, interval_steps: int) -> list[int]:
    """The periodic saves of a run that saves every ``interval_steps``, its last step excluded."""
    return list(range(interval_steps, num_steps, interval_steps)) if interval_steps > 0 else []


def interval_needed(num_steps: int, num_save_faults: int, interval_steps: int) -> int | None:
    """The ``checkpoint.interval_steps`` a campaign must set, or None to keep the config's: a run
    that never saves by steps has no final checkpoint to compare, and each save fault needs a save
    of its own before the last step."""
    if interval_steps > 0 and len(save_steps(num_steps, interval_steps)) >= num_save_faults:
        return None
    return max(1, min(num_steps // SAVES_PER_RUN, num_steps // (num_save_faults + 1)))


def draw_faults(
    kinds: Sequence[str], *, num_steps: int, interval_steps: int, num_ranks: int, seed: int
) -> list[Fault]:
    """A fault of each of ``kinds`` (as ``deal_kinds`` dealt them) at a distinct step, on a drawn
    rank; sorted by step, ids in that order."""
    rng = random.Random(f"goodput chaos steps {seed}")
    num_save_faults = sum(kind in IN_SAVE for kind in kinds)
    saves = save_steps(num_steps, interval_steps)
    if num_save_faults > len(saves):
        raise _does_not_fit(
            f"{num_save_faults} checkpoint faults need as many saves before the last step; "
            f"saving every {interval_steps} steps of {num_steps} gives {len(saves)}"
        )
    taken = rng.sample(saves, num_save_faults)
    free = sorted(set(range(1, num_steps)) - set(taken))
    num_other = len(kinds) - num_save_faults
    if num_other > len(free):
        raise _does_not_fit(f"{len(kinds)} faults at distinct steps need more than {num_steps}")
    steps_of_save_faults, steps_of_others = iter(taken), iter(rng.sample(free, num_other))
    drawn = [
        (next(steps_of_save_faults if kind in IN_SAVE else steps_of_others), kind) for kind in kinds
    ]
    return [
        Fault(id=index, kind=kind, step=step, rank=rng.randrange(num_ranks))
        for index, (step, kind) in enumerate(sorted(drawn))
    ]


def write_plan(path: Path, faults: Sequence[Fault], fired_dir: Path) -> None:
    """The plan file ``GOODPUT_FAULTS`` names, written atomically; checked by the trainer's own
    parser first, so a plan chaos writes is one the trainer takes."""
    plan = {
        "fired_dir": str(fired_dir.absolute()),
        "faults": [
            {"id": fault.id, "kind": fault.kind, "step": fault.step, "rank": fault.rank}
            for fault in faults
        ],
    }
    parse_plan(plan)
    write_json(path, plan)


def _does_not_fit(what: str) -> GoodputError:
    return GoodputError.usage(
        "--faults", what, "ask for fewer faults, or run more steps (train.steps=N)"
    )
