"""The step's vote: after each step every rank hands every rank what the step's hooks decide
together (``StepHooks.decide``), in a fixed number of integers whatever the world size.

A rank's ``Ballot`` (its named fields) and what comes back to every rank alike, the ``Tally``:

- ``sigterm``: the scheduler's warning reached this rank; on any rank, every rank stops
  (``Checkpointer.decide``);
- ``minutes_due``: this rank's clock says the checkpoint's minutes interval has passed
  (``Checkpointer.minutes_due``); on any rank, it counts for all;
- ``snapshot_ok``: this rank's last in-memory checkpoint completed (``SnapshotStore.settle``);
  only when it did on every rank do all commit it, else all keep the one before;
- ``busy_s``: this rank's busy time of the step (``stragglers.BusyClock``); every rank gets
  their spread (``spread.Spread``: least, median, most and the slowest rank), never W numbers.

The wire (``monitor.wire``): one SUM of ``[sigterm, minutes_due, snapshot_failed]`` (1 or 0
from each rank: set when the sum is above 0) and the busy time's histogram (581 integers), then
one MAX of its extremes (2): 4.7 KB at any world size, on the training's own process group from
the main thread (``monitor.wire``: no group of its own to make or connect). The checkpoint's
flush runs its collectives on its own group from its thread, so the two never pair up. Each
wait is bracketed for the beacon (site ``ckpt.vote``); the caller sets the ``vote`` phase.
"""

from __future__ import annotations

from dataclasses import dataclass

from goodput.train.monitor import spread
from goodput.train.monitor.wire import Wire


@dataclass(frozen=True, slots=True, kw_only=True)
class Ballot:
    """What this rank brings to the step's vote (see the module docstring)."""

    sigterm: bool
    minutes_due: bool
    snapshot_ok: bool
    busy_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Tally:
    """The step's vote as every rank sees it: ``sigterm`` and ``minutes_due`` true when true on
    any rank, ``snapshots_ok`` when true on every rank, ``busy`` the spread of busy times."""

    sigterm: bool
    minutes_due: bool
    snapshots_ok: bool
    busy: spread.Spread


FLAGS = 3  # sigterm, minutes_due, snapshot_failed: the SUM's first slots


def cast(wire: Wire, ballot: Ballot) -> Tally:
    """Collective: every rank's ``ballot`` in, the same ``Tally`` out on every rank."""
    flags = [int(ballot.sigterm), int(ballot.minutes_due), int(not ballot.snapshot_ok)]
    busy_us = spread.micros(ballot.busy_s)
    summed = wire.reduce(flags + spread.histogram(busy_us), "sum", "ckpt.vote")
    most = wire.reduce(spread.extremes(busy_us, wire.rank), "max", "ckpt.vote")
    sigterm, minutes_due, snapshot_failed = (vote > 0 for vote in summed[:FLAGS])
    return Tally(
        sigterm=sigterm,
        minutes_due=minutes_due,
        snapshots_ok=not snapshot_failed,
        busy=spread.Spread.of(summed[FLAGS:], most),
    )
