"""The per-step work around the training step, for the loop: one object, called in the order the
step runs, so ``loop.train`` stays a list of what happens.

- Where this rank is (``goodput.beacon``): ``open_rank_beacon`` opens the beacon file as soon
  as the process group is up, when the launcher set ``GOODPUT_BEACON_DIR`` (phase ``startup``:
  a hang while the model is built or a checkpoint loaded has a beacon and a stack dump too);
  the loop closes it (its files removed) however it ends. The hooks give it the schedule id (a
  hash of the rank's pp/tp/cp coordinates: ranks of one id issue the same collectives), each
  step and the loop's phases (``data``, ``eval``, ``metrics``, ``done``; ``train_step`` and the
  checkpointer set theirs; ``forward`` from just before ``train_step``, where a ``slow`` fault
  sleeps).
- The step's vote (``step_vote.cast``: a SUM and a MAX of a fixed size, on the training's own
  group): ``decide`` hands every rank each rank's SIGTERM, checkpoint clock and in-memory
  checkpoint outcome, and the spread of busy times; the checkpoint's decision
  (``Checkpointer.decide``) is taken from what it voted.
- Busy time (``stragglers.BusyClock``) from the data phase to the vote, the eval apart; shared
  by the vote and judged by the straggler watch (``stragglers.StragglerWatch``).
- Injected faults (``goodput.faults``, under ``goodput chaos``): ``before_data`` in the data
  phase, ``before_step`` just before ``train_step``, ``after_step`` once the step is over.
- The profiler (``[profile]``, ``profiling.py``): ``before_step``/``after_step`` around each
  step, ``close`` when the loop is left. None when off: nothing is called.
- In-memory checkpoints (snapshots for short: ``[checkpoint] memory_interval_steps``,
  ``checkpoint.snapshot``): ``decide`` first settles the previous snapshot (waits for its
  background checksums and partner copy), its outcome rides the vote, and then every rank alike
  commits it (drops the one before) or, when it failed anywhere, keeps the one before;
  ``snapshot`` after the step's save takes one every k steps (``schedule.snapshot_step``) and at
  every disk save (from the save's host copy when it staged one). The main
  thread's copy and the settling wait are the step's ``snapshot_stall_s``, in the next step's
  record as ``checkpoint_stall_s`` is. A ``host-loss`` fault first forgets this host's
  snapshots (``FaultPlan.host_loss_hook``). The store is closed however the loop ends; its
  files are removed only once every step has run (an error exit keeps them: that is the point).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from goodput import beacon
from goodput.checkpoint.save import Checkpointer, Decision
from goodput.checkpoint.schedule import snapshot_step
from goodput.faults import FaultPlan
from goodput.launch.env import current_placement
from goodput.ranks import rank_host
from goodput.train.build import Run
from goodput.train.config.run import RunConfig
from goodput.train.monitor.stragglers import BusyClock, StragglerWatch
from goodput.train.monitor.wire import ProcessWire
from goodput.train.profiling import Profiler, build_profiler
from goodput.train.setup import Runtime
from goodput.train.step_vote import Ballot, cast

Measured = dict[str, float | int | str | None]


class StepHooks:
    """What the loop does around each step besides the step (see the module docstring)."""

    def __init__(
        self, cfg: RunConfig, run: Run, faults: FaultPlan | None, *, first_step: int
    ) -> None:
        runtime = run.runtime
        self.rank, self.faults = runtime.rank, faults
        self.snapshots, self.snapshot_every = run.snapshots, cfg.checkpoint.memory_interval_steps
        self.snapshot_stall = 0.0  # held since the last step record: the next one's
        if faults is not None and self.snapshots is not None:
            faults.host_loss_hook = self.snapshots.forget_host
        self.beacon = beacon.current()
        self.beacon.set_schedule(schedule_id(run))
        self.wire = ProcessWire(runtime.device)
        self.busy = BusyClock()
        self.stragglers = StragglerWatch(cfg.watch, run.hosts, self.wire, run_dir=run.run_dir)
        self.profiler: Profiler | None = build_profiler(
            cfg.profile,
            run.run_dir,
            rank=runtime.rank,
            first_step=first_step,
            last_step=cfg.train.steps,
        )

    def __enter__(self) -> StepHooks:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.beacon.phase("done")
        if self.profiler is not None:
            self.profiler.close()
        if self.snapshots is not None:  # finished: no exception, so every step has run
            self.snapshots.close(finished=kind is None)

    def start(self, step: int) -> None:
        """The top of step ``step``."""
        self.beacon.step(step)
        if self.profiler is not None:
            self.profiler.before_step(step)

    def data(self, step: int) -> None:
        """The data phase begins: so does the step's busy time."""
        self.beacon.phase("data")
        self.busy.start()
        if self.faults is not None:
            self.faults.before_data(step, self.rank)

    def before_step(self, step: int) -> None:
        """Just before ``train_step``: the batch is read, the step's work begins."""
        self.beacon.phase("forward")
        if self.faults is not None:
            self.faults.before_step(step, self.rank)

    @contextmanager
    def eval(self) -> Iterator[None]:
        """Around the in-loop eval: its own phase, not busy time."""
        self.beacon.phase("eval")
        with self.busy.apart():
            yield

    def decide(
        self, checkpointer: Checkpointer, step: int, *, last_step: int, sigterm: bool
    ) -> tuple[Decision, Measured]:
        """The step's vote (this rank's SIGTERM, checkpoint clock, snapshot outcome and busy
        time) and the checkpoint's decision taken from it; the straggler watch's
        fields of the step, and the snapshot stall held since the last step record."""
        busy_s = self.busy.seconds()  # the settling below is no busy time
        self.beacon.phase("vote")  # a partner that never answers shows here, not in a step
        measured: Measured = {}
        snapshot_ok = True
        if self.snapshots is not None:
            snapshot_ok, waited = self.snapshots.settle()
            measured["snapshot_stall_s"], self.snapshot_stall = self.snapshot_stall, waited
        ballot = Ballot(
            sigterm=sigterm,
            minutes_due=checkpointer.minutes_due(),
            snapshot_ok=snapshot_ok,
            busy_s=busy_s,
        )
        tally = cast(self.wire, ballot)
        decision = checkpointer.decide(
            step, last_step=last_step, sigterm=tally.sigterm, minutes_due=tally.minutes_due
        )
        if self.snapshots is not None:
            self.snapshots.commit(tally.snapshots_ok)
        measured |= self.stragglers.observe(step, busy_s, tally.busy)
        self.beacon.phase("metrics")
        return decision, measured

    def snapshot(self, step: int, decision: Decision, checkpointer: Checkpointer) -> None:
        """After the step's save, if any: an in-memory checkpoint every k steps and at every
        disk save, copied from the save's host copy when it staged one. None before a stop: the
        save of that step is synchronous, and the run ends."""
        if self.snapshots is None or decision.stops:
            return
        if not snapshot_step(step, self.snapshot_every) and not decision.saves:
            return
        staged = checkpointer.staged if decision.saves else None
        self.snapshot_stall += self.snapshots.take(step, checkpointer.contents, staged)

    def evicts(self, decision: Decision) -> bool:
        """Whether this save is the last one, to replace a straggler's host."""
        return self.stragglers.evicts(decision, os.environ)

    def end(self, step: int) -> None:
        """Step ``step`` is over (its metrics written, its save started)."""
        if self.profiler is not None:
            self.profiler.after_step(step)
        if self.faults is not None:
            self.faults.after_step(step, self.rank)


def open_rank_beacon(runtime: Runtime) -> None:
    """This rank's beacon file, when ``goodput launch`` gave a folder for it (``open_beacon``),
    at step 0 (none yet) in phase ``startup`` (a second run in one process starts over too)."""
    beacon.current().step(0)
    beacon.current().phase("startup")
    beacon.open_beacon(
        os.environ,
        rank=runtime.rank,
        world_size=runtime.world_size,
        local_rank=current_placement().local_rank,
        host=rank_host(runtime.rank, os.environ),
    )


def schedule_id(run: Run) -> int:
    """A hash of this rank's pipeline, tensor and context-parallel coordinates: ranks with the
    same id issue the same sequence of collectives (hang forensics compares only those)."""
    mesh = run.mesh.device_mesh
    coordinates = ",".join(f"{dim}={mesh.get_local_rank(dim)}" for dim in ("pp", "tp", "cp"))
    return zlib.crc32(coordinates.encode())
