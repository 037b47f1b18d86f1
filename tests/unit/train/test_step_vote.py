"""The step's vote (``train.step_vote``) on real gloo ranks: every rank takes the same checkpoint
decision from it, whichever rank saw SIGTERM or a late clock; it hands every rank every rank's
busy time exactly, and a snapshot that failed on one rank to every rank."""

import time

import pytest
import torch

from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.save import Checkpointer, Decision
from goodput.checkpoint.state import CheckpointContents
from goodput.testing.dist import run_distributed
from goodput.train.step_vote import Ballot, StepVote

# Each rank's busy time: 1e17 + 1.0 rounds the 1.0 away, so only slots each rank writes alone
# hand it back exactly.
SHARES = [1e17, 1.0]


def decisions(rank, world_size, tmp_path, cfg, sigterm_rank, late_rank):
    """Each step's decision of 8, with SIGTERM on ``sigterm_rank`` only at step 6 and the last
    save minutes ago on ``late_rank`` only (no save happens, so it stays minutes ago); every
    vote hands every rank every rank's busy time, exactly."""
    nothing = CheckpointContents(parts=[], optimizers=[])
    checkpointer = Checkpointer(CheckpointConfig(**cfg), tmp_path, torch.device("cpu"), nothing)
    vote = StepVote()
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
            tally = vote.cast(ballot)
            decided.append(
                checkpointer.decide(
                    step, last_step=8, sigterm=tally.sigterm, minutes_due=tally.minutes_due
                )
            )
            assert list(tally.busy_s) == SHARES
        return decided
    finally:
        vote.close()
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
    vote = StepVote()
    try:
        seen = []
        for step in (1, 2):
            failed = rank == 1 and step == 1
            ballot = Ballot(sigterm=False, minutes_due=False, snapshot_ok=not failed, busy_s=0.0)
            seen.append(not vote.cast(ballot).snapshots_ok)
        return seen
    finally:
        vote.close()


def test_the_vote_carries_a_failed_snapshot_to_every_rank():
    assert run_distributed(snapshot_failures, 2) == [[True, False], [True, False]]
