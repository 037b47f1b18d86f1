"""The step's vote: after each step, in one all-reduce, every rank hands every rank what the
step's hooks decide together (``StepHooks.decide``).

A rank's ``Ballot`` (its named fields) and what comes back to every rank alike, the ``Tally``:

- ``sigterm``: the scheduler's warning reached this rank; on any rank, every rank stops
  (``Checkpointer.decide``);
- ``minutes_due``: this rank's clock says the checkpoint's minutes interval has passed
  (``Checkpointer.minutes_due``); on any rank, it counts for all;
- ``snapshot_ok``: this rank's last in-memory checkpoint completed (``SnapshotStore.settle``);
  only when it did on every rank do all commit it, else all keep the one before;
- ``busy_s``: this rank's busy time of the step (``stragglers.BusyClock``); every rank gets every
  rank's, by rank, for the straggler watch.

The wire: one float64 vector ``[sigterm, minutes_due, snapshot_failed, busy_0 .. busy_{W-1}]``
summed over the ranks, in which each rank writes its flags (1.0 or 0.0) and only its own busy
slot, so the sum hands every rank every busy time exactly (a number plus zeros), whatever the
order of the reduction, and a flag is set when its sum is above 0. The vote runs on a gloo group
of its own: the flush of the previous checkpoint save may still be running collectives on the
checkpoint's group from its thread, and two threads' collectives on one group pair up in a
different order on each rank and hang. The wait is bracketed for the beacon (site
``ckpt.vote``); the caller sets the ``vote`` phase.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from goodput import beacon

FLAGS = 3  # sigterm, minutes_due, snapshot_failed: the vector's first slots


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
    any rank, ``snapshots_ok`` when true on every rank, ``busy_s`` every rank's, by rank."""

    sigterm: bool
    minutes_due: bool
    snapshots_ok: bool
    busy_s: tuple[float, ...]


class StepVote:
    """The step's vote of one run; one instance per rank, created by every rank at the same
    point (it creates its own gloo group)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")  # collective

    def cast(self, ballot: Ballot) -> Tally:
        """Collective: every rank's ``ballot`` in, the same ``Tally`` out on every rank."""
        world_size = dist.get_world_size(self.group)
        votes = torch.zeros(FLAGS + world_size, dtype=torch.float64)
        flags = [ballot.sigterm, ballot.minutes_due, not ballot.snapshot_ok]
        votes[:FLAGS] = torch.tensor(flags, dtype=torch.float64)
        votes[FLAGS + dist.get_rank(self.group)] = ballot.busy_s
        if world_size > 1:
            with beacon.current().collective("ckpt.vote"):
                dist.all_reduce(votes, op=dist.ReduceOp.SUM, group=self.group)
        values = votes.tolist()
        sigterm, minutes_due, snapshot_failed = (vote > 0 for vote in values[:FLAGS])
        return Tally(
            sigterm=sigterm,
            minutes_due=minutes_due,
            snapshots_ok=not snapshot_failed,
            busy_s=tuple(values[FLAGS:]),
        )

    def close(self) -> None:
        dist.destroy_process_group(self.group)
