"""The step's vote (``train.step_vote``) on real gloo ranks: every rank takes the same checkpoint
decision from it, whichever rank saw SIGTERM or a late clock; it hands every rank the spread of
busy times (least, median, most and the slowest rank), and a snapshot that failed on one rank to
every rank."""

import time

import pytest
import torch

from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.save import Checkpointer, Decision
from goodput.checkpoint.state import CheckpointContents
from goodput.testing.dist import run_distributed
from goodput.train.monitor.wire import ProcessWire
from goodput.train.step_vote import Ballot, cast

SHARES = [1.5, 0.25]  # each rank's busy time


def decisions(rank, world_size, tmp_path, cfg, sigterm_rank, late_rank):
    """Each step's decision of 8, with SIGTERM on ``sigterm_rank`` only at step 6 and the last
    save minutes ago on ``late_rank`` only (no save happens, so it stays minutes ago); every
    vote hands every rank the spread of busy times, exactly."""
    nothing = CheckpointContents(parts=[], optimizers=[])
    checkpointer = Checkpointer(CheckpointConfig(**cfg), tmp_path, torch.device("cpu"), nothing)
    wire = ProcessWire(torch.device("cpu"))
    if rank == late_rank:
        checkpointer.last_save = time.monotonic() - 120
    try:
        decided = []
        for step in range(1, 9):
            sigterm = rank == sigterm_rank and step == 6
            ballot = Ballot(
                sigterm=sigterm,
                minutes_due=checkpointer.minutes_due(),
                snapshot_ok=True,
                busy_s=SHARES[rank],
            )
            tally = cast(wire, ballot)
            decided.append(
                checkpointer.decide(
                    step, last_step=8, sigterm=tally.sigterm, minutes_due=tally.minutes_due
                )
            )
            spread = tally.busy
            assert (spread.min_s, spread.median_s, spread.max_s) == (0.25, 0.875, 1.5)
            assert spread.slowest_rank == 0
        return decided
    finally:
        checkpointer.close()


N, P, F, S = Decision.NONE, Decision.PERIODIC, Decision.FINAL, Decision.STOP


@pytest.mark.parametrize(
    ("cfg", "sigterm_rank", "late_rank", "expected"),
    [
        ({"interval_steps": 4}, None, None, [N, N, N, P, N, N, N, P]),
        ({}, None, None, [N] * 8),  # no interval: not even the last step
        ({"interval_steps": 3}, 1, None, [N, N, P, N, N, F, N, P]),
        ({"interval_steps": 3, "save_on_sigterm": False}, 0, None, [N, N, P, N, N, S, N, P]),
        ({"interval_minutes": 1.0}, None, 1, [P] * 8),  # the late rank's clock counts for all
    ],
)
def test_every_rank_takes_the_same_decision(tmp_path, cfg, sigterm_rank, late_rank, expected):
    for rank_decisions in run_distributed(decisions, 2, tmp_path, cfg, sigterm_rank, late_rank):
        assert rank_decisions == expected
    assert [d.saves for d in (N, P, F, S)] == [False, True, True, False]
    assert [d.stops for d in (N, P, F, S)] == [False, False, True, True]


def snapshot_failures(rank: int, world_size: int) -> list[bool]:
    """Whether a snapshot failed anywhere, as every rank sees it: failed on rank 1 only, at the
    first vote."""
    wire = ProcessWire(torch.device("cpu"))
    seen = []
    for step in (1, 2):
        failed = rank == 1 and step == 1
        ballot = Ballot(sigterm=False, minutes_due=False, snapshot_ok=not failed, busy_s=0.0)
        seen.append(not cast(wire, ballot).snapshots_ok)
    return seen


def test_the_vote_carries_a_failed_snapshot_to_every_rank():
    assert run_distributed(snapshot_failures, 2) == [[True, False], [True, False]]
