"""The fault plan of a chaos campaign, drawn from a seed: which faults, at which steps, on which
ranks, and how often the run must save for them.

The same seed, count, kinds, steps, intervals, ranks and watch window give the same plan. Kinds are
dealt evenly: each kind of ``kinds`` appears ``num_faults // len(kinds)`` or one more times, in
an order drawn from the seed, so that a campaign of at least as many faults as kinds tries every
kind. Steps are distinct and leave the run its last step to finish after the last fault:
  - each ``slow`` fault gets a window of its own, ``[step, step + window)`` inside
    ``[1, steps - 1]`` (``window``: the straggler watch's ``straggler_steps`` plus
    ``SLOW_MARGIN``, so that a whole watch window falls in it, wherever the watch's windows
    start); no other fault sits in one, so a slow rank is named alone, never beside a stall; and
    windows lie ``2 x straggler_steps - 1`` steps apart at least (``quiet_steps``), so that a
    whole watch window between two of them sees every rank at its pace again, and the watch,
    which names a rank once per lag, names it again in the next;
  - ``ckpt-kill`` and ``save-fail`` fire in a checkpoint save, so each gets a save step of its
    own (a multiple of the interval before the last step, outside the windows): no two of them
    meet in one save, and a failed save is never the final one, whose checkpoint the campaign
    compares;
  - ``snapshot-kill`` fires in an in-memory checkpoint, so each gets a snapshot step of its own (a
    multiple of ``checkpoint.memory_interval_steps`` before the last step, outside the windows
    and the save faults' steps): the snapshot it kills is the one of its step;
  - every other kind gets any other step in [1, steps - 1] outside the windows.
Ranks are drawn uniformly below ``num_ranks``; a ``stall``'s ``where`` is dealt evenly between
``data`` and ``collective``. A ``slow`` fault's ``seconds`` are not drawn: the campaign times
them from the straight run (``timed``) before the plan is written. The file written is the one
``goodput.faults`` reads (its docstring has the format); ids number the faults in step order. A
plan that cannot fit (more faults than steps) is a usage error naming ``--faults``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path

from goodput.checkpoint.schedule import periodic_save, snapshot_step
from goodput.errors import GoodputError
from goodput.faults import IN_SAVE, IN_SNAPSHOT, STALL_WHERE, Fault, parse_plan
from goodput.io import write_json

SAVES_PER_RUN = 10  # the interval chaos sets, when it must set one: steps // this
SLOW_MARGIN = 5  # a slow window's steps beyond the watch's: room for a window not aligned to it


def deal_kinds(num_faults: int, kinds: Sequence[str], seed: int) -> list[str]:
    """``num_faults`` kinds from ``kinds``, as evenly as they divide, in a drawn order."""
    return _deal(num_faults, kinds, random.Random(f"goodput chaos kinds {seed}"))


def _deal(count: int, values: Sequence[str], rng: random.Random) -> list[str]:
    """``count`` values from ``values``, as evenly as they divide, in an order ``rng`` draws."""
    order = list(values)
    rng.shuffle(order)
    dealt = [order[i % len(order)] for i in range(count)]
    rng.shuffle(dealt)
    return dealt


def slow_window(straggler_steps: int) -> int:
    """The steps of a ``slow`` fault's window, for a watch of ``straggler_steps`` steps."""
    return straggler_steps + SLOW_MARGIN


def quiet_steps(straggler_steps: int) -> int:
    """The fewest steps between two slow windows: room for a whole watch window."""
    return 2 * straggler_steps - 1


def save_steps(num_steps: int, interval_steps: int) -> list[int]:
    """The periodic saves of a run that saves every ``interval_steps``, its last step excluded
    (the checkpoint's own rule, ``schedule.periodic_save``)."""
    return [step for step in range(1, num_steps) if periodic_save(step, interval_steps)]


def snapshot_steps(num_steps: int, memory_interval_steps: int) -> list[int]:
    """The in-memory checkpoints by interval of a run that takes one every
    ``memory_interval_steps``, its last step excluded (``schedule.snapshot_step``)."""
    return [step for step in range(1, num_steps) if snapshot_step(step, memory_interval_steps)]


def interval_needed(num_steps: int, num_save_faults: int, interval_steps: int) -> int | None:
    """The ``checkpoint.interval_steps`` a campaign must set, or None to keep the config's: a run
    that never saves by steps has no final checkpoint to compare, and each save fault needs a save
    of its own before the last step."""
    if interval_steps > 0 and len(save_steps(num_steps, interval_steps)) >= num_save_faults:
        return None
    return max(1, min(num_steps // SAVES_PER_RUN, num_steps // (num_save_faults + 1)))


def draw_faults(
    kinds: Sequence[str],
    *,
    num_steps: int,
    interval_steps: int,
    num_ranks: int,
    seed: int,
    straggler_steps: int,
    snapshot_interval_steps: int = 0,
) -> list[Fault]:
    """A fault of each of ``kinds`` (as ``deal_kinds`` dealt them) at a distinct step, on a drawn
    rank, each ``slow`` one with its window for a watch of ``straggler_steps`` (its ``seconds``
    left to ``timed``), each ``snapshot-kill`` on a step of a run that snapshots every
    ``snapshot_interval_steps`` (0: never); sorted by step, ids in that order."""
    rng = random.Random(f"goodput chaos steps {seed}")
    num_slow = list(kinds).count("slow")
    window = slow_window(straggler_steps)
    windows = _windows(num_slow, window, quiet_steps(straggler_steps), num_steps, rng)
    in_windows = {step for start in windows for step in range(start, start + window)}
    num_save_faults = sum(kind in IN_SAVE for kind in kinds)
    saves = [step for step in save_steps(num_steps, interval_steps) if step not in in_windows]
    if num_save_faults > len(saves):
        raise _does_not_fit(
            f"{num_save_faults} checkpoint faults need as many saves before the last step "
            f"(outside the slow faults' windows); saving every {interval_steps} steps of "
            f"{num_steps} gives {len(saves)}"
        )
    taken = rng.sample(saves, num_save_faults)
    free = sorted(set(range(1, num_steps)) - set(taken) - in_windows)
    snapshots = _snapshot_steps(kinds, free, num_steps, snapshot_interval_steps, rng)
    free = [step for step in free if step not in snapshots]
    num_other = len(kinds) - num_save_faults - num_slow - len(snapshots)
    if num_other > len(free):
        raise _does_not_fit(f"{len(kinds)} faults at distinct steps need more than {num_steps}")
    starts = {
        "save": iter(taken),
        "slow": iter(windows),
        "snapshot": iter(snapshots),
        "other": iter(rng.sample(free, num_other)),
    }
    drawn = sorted((next(starts[_placement(kind)]), kind) for kind in kinds)
    ranks = [rng.randrange(num_ranks) for _ in drawn]
    wheres = iter(_deal(list(kinds).count("stall"), STALL_WHERE, rng))  # last: older plans hold
    return [
        Fault(
            id=index,
            kind=kind,
            step=step,
            rank=rank,
            steps=window if kind == "slow" else None,
            where=next(wheres) if kind == "stall" else None,
        )
        for index, ((step, kind), rank) in enumerate(zip(drawn, ranks, strict=True))
    ]


def _placement(kind: str) -> str:
    if kind in IN_SAVE:
        return "save"
    return "snapshot" if kind in IN_SNAPSHOT else "slow" if kind == "slow" else "other"


def _snapshot_steps(
    kinds: Sequence[str], free: list[int], num_steps: int, interval: int, rng: random.Random
) -> list[int]:
    """A snapshot step of its own, from ``free``, for each snapshot fault of ``kinds``; drawn
    only when there are some, so a plan without them is drawn as before they existed."""
    count = sum(kind in IN_SNAPSHOT for kind in kinds)
    if not count:
        return []
    snapshots = sorted(set(snapshot_steps(num_steps, interval)) & set(free))
    if count > len(snapshots):
        raise _does_not_fit(
            f"{count} snapshot fault(s) need as many memory snapshots before the last step "
            f"(outside the other faults' steps); snapshotting every {interval} steps of "
            f"{num_steps} gives {len(snapshots)}"
        )
    return rng.sample(snapshots, count)


def _windows(count: int, window: int, quiet: int, num_steps: int, rng: random.Random) -> list[int]:
    """The first steps of ``count`` windows of ``window`` steps in [1, num_steps - 1], at least
    ``quiet`` steps apart, drawn uniformly: each window but the last, with its quiet steps after
    it, and the steps left over are laid in a drawn order."""
    if not count:
        return []
    left = num_steps - 1 - count * window - (count - 1) * quiet  # the steps left over
    if left < 0:
        raise _does_not_fit(
            f"{count} slow fault(s) need a window of {window} steps each (the straggler watch's "
            f"watch.straggler_steps + {SLOW_MARGIN}), {quiet} steps apart, before the last of "
            f"{num_steps} steps"
        )
    # Of the count + left places in a row, the windows take count; each earlier window, with
    # its quiet steps, shifts the later ones by its length less the one place it takes.
    places = sorted(rng.sample(range(count + left), count))
    return [1 + place + index * (window + quiet - 1) for index, place in enumerate(places)]


def timed(faults: Sequence[Fault], seconds: float) -> list[Fault]:
    """The plan with every ``slow`` fault sleeping ``seconds`` a step."""
    return [
        dataclasses.replace(fault, seconds=seconds) if fault.kind == "slow" else fault
        for fault in faults
    ]


def write_plan(path: Path, faults: Sequence[Fault], fired_dir: Path) -> None:
    """The plan file ``GOODPUT_FAULTS`` names, written atomically; checked by the trainer's own
    parser first, so a plan chaos writes is one the trainer takes."""
    plan = {
        "fired_dir": str(fired_dir.absolute()),
        "faults": [fault.keys() for fault in faults],
    }
    parse_plan(plan)
    write_json(path, plan)


def _does_not_fit(what: str) -> GoodputError:
    return GoodputError.usage(
        "--faults", what, "ask for fewer faults, or run more steps (train.steps=N)"
    )
