"""SIGTERM (the scheduler's walltime warning) as a flag, and decisions every rank takes together.

The handler only sets a flag: the loop finishes its step, saves if asked, and exits 143. Ranks
receive the signal at slightly different moments, so each step they agree on every such
decision (an all-reduce MAX over the checkpoint group); otherwise one rank would enter a save
while another entered the next step, and both would hang.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

import torch
import torch.distributed as dist


class SigtermFlag:
    """``with SigtermFlag() as flag:`` — ``flag.is_set()`` once SIGTERM arrived."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.previous: object = None

    def __enter__(self) -> SigtermFlag:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


def agree(flags: list[bool], group: dist.ProcessGroup) -> list[bool]:
    """Each flag true on every rank if it is true on any."""
    if dist.get_world_size(group) == 1:
        return flags
    votes = torch.tensor([int(flag) for flag in flags])
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
    return [bool(vote) for vote in votes.tolist()]
