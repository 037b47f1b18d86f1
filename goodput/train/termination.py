"""SIGTERM (the scheduler's walltime warning) as a flag.

The handler only sets a flag: the loop finishes its step, saves if asked, and exits 143. The
ranks decide that together, after each step (the step's vote, ``step_vote``, then
``Checkpointer.decide``).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType


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
