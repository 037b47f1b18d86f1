"""The ``[checkpoint]`` table.

No key here is refused as inert (``config.refuse_inert_keys``), though some do nothing under others
(``async_save`` without periodic saves, what resume reads with ``resume = "never"``): commands
turn saving and resuming off on a user's config (``goodput diagnose smoke``, ``--resume
never``), and the keys stay that config's settings for its real runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from goodput.config import NON_EMPTY, limits


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointConfig:
    interval_steps: int = 0  # save every N steps; 0: not by steps
    interval_minutes: float = 0.0  # save when this much wall time has passed; 0: not by time
    # complete checkpoints kept; older ones are pruned after a new one completes
    keep_last: int = field(default=3, metadata=limits(at_least=1))
    # Milestones: complete checkpoints whose step is a multiple of this are kept beyond
    # keep_last (for a study that needs them later); 0: none.
    keep_every_steps: int = field(default=0, metadata=limits(at_least=0, at_most=2**40))
    async_save: bool = True  # the step only waits for the copy to host memory (DCP's staging)
    # ranks writing at the same moment, in waves
    max_concurrent_writers: int = field(default=64, metadata=limits(at_least=1))
    resume: str = field(default="auto", metadata=NON_EMPTY)  # auto | never | a checkpoint dir
    allow_data_change: bool = False  # resume even if the data fingerprint differs
    save_on_sigterm: bool = True  # a final synchronous save when the scheduler sends SIGTERM
    folder: str | None = None  # default: RUN/checkpoints
    # The --dest of `goodput broadcast --checkpoint`: resume reads this host's copy of the
    # chosen checkpoint from here once its checksums match. Saves never go here.
    local_dir: str | None = None
    # Resume hashes the checkpoint's files against checksums.json, split over all ranks (about
    # 1 s per GB per rank, README: Trust); false skips that, e.g. on a filesystem known intact.
    verify_checksums: bool = True
    # In-memory checkpoints (snapshots for short, checkpoint/snapshot/): every N steps each
    # rank's state goes into host memory that outlives the process, with a copy on a rank of the
    # next host; a restart loads the newest step every rank has, else the disk checkpoint. 0: off.
    memory_interval_steps: int = field(default=0, metadata=limits(at_least=0, at_most=2**40))
    # Where the snapshots live: default /dev/shm when it is a writable folder, else the
    # temporary folder. Node-local memory (a tmpfs) is the point: a disk folder works, slowly.
    memory_dir: str | None = field(default=None, metadata=NON_EMPTY)
