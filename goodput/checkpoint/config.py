"""The ``[checkpoint]`` table."""

from __future__ import annotations

from dataclasses import dataclass

from goodput.errors import GoodputError


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointConfig:
    interval_steps: int = 0  # save every N steps; 0: not by steps
    interval_minutes: float = 0.0  # save when this much wall time has passed; 0: not by time
    keep_last: int = 3  # complete checkpoints kept; older ones are pruned after a new one completes
    async_save: bool = True  # the step only waits for the snapshot to host memory
    max_concurrent_writers: int = 64  # ranks writing at the same moment, in waves
    resume: str = "auto"  # auto | never | a checkpoint directory
    allow_data_change: bool = False  # resume even if the data fingerprint differs
    save_on_sigterm: bool = True  # a final synchronous save when the scheduler sends SIGTERM
    folder: str | None = None  # default: RUN/checkpoints
    # The --dest of `goodput broadcast --checkpoint`: resume reads this host's copy of the
    # chosen checkpoint from here once its checksums match. Saves never go here.
    local_dir: str | None = None
    # Resume hashes the checkpoint's files against checksums.json, split over all ranks (about
    # 1 s per GB per rank, README: Trust); false skips that, e.g. on a filesystem known intact.
    verify_checksums: bool = True

    def __post_init__(self) -> None:
        def fail(what: str, fix: str) -> None:
            raise GoodputError.usage("[checkpoint]", what, fix)

        if self.interval_steps < 0 or self.interval_minutes < 0:
            fail("intervals must be >= 0", "use 0 to turn one off")
        if self.keep_last < 1:
            fail(f"keep_last = {self.keep_last} must be >= 1", "keep at least the newest one")
        if self.max_concurrent_writers < 1:
            fail(
                f"max_concurrent_writers = {self.max_concurrent_writers} must be >= 1",
                "set it to at least 1",
            )
