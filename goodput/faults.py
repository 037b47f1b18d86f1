"""Injected faults: the plan ``goodput chaos`` hands a run, and the hooks through which the
trainer and the checkpoint writer make each fault happen at its moment.

Off unless ``GOODPUT_FAULTS`` names a plan file by absolute path; ``load_plan`` then reads it
once, at start. Without it the trainer pays one environment lookup and nothing per step.

The plan file: JSON, at most 1 MiB and 10,000 faults; an unknown key or kind, a missing key, a
key the fault's kind does not take, a number out of range or a repeated ``id`` refuses the whole
file::

    {"fired_dir": "/abs/path/fired",
     "faults": [{"id": 0, "kind": "kill", "step": 37, "rank": 1},
                {"id": 1, "kind": "slow", "step": 40, "rank": 0, "seconds": 0.1, "steps": 25},
                {"id": 2, "kind": "stall", "step": 70, "rank": 1, "where": "data"}, ...]}

``id`` is unique, 0 <= id < 2**31; ``step`` >= 1; ``rank`` >= 0 is the global rank the fault
fires on (never on another). Every kind takes these four keys; ``slow`` and ``stall`` take keys
of their own too (``KIND_KEYS``), which they must have and no other kind may. At start the
trainer refuses, naming it, a fault that could never fire (``check_reachable``): a rank not
below the world size, a step after ``train.steps``, a save fault in a run without periodic
saves, a snapshot fault (``NEEDS_SNAPSHOTS``) in a run without in-memory checkpoints
(``checkpoint.memory_interval_steps = 0``). The kinds, and when each fires:

- ``kill``: once step ``step`` has completed (its metrics line written, its checkpoint decision
  taken and any save started), the rank SIGKILLs itself.
- ``hang``: the same moment, it SIGSTOPs itself; its peers block in their next collective.
- ``bad-node``: the same moment, it prints ``goodput: error: rank R on HOST: CUDA error: device
  lost (injected by goodput chaos)`` to stderr — the device-error evidence the launcher looks
  for — and exits 1. HOST is the launcher's name for this rank's host (``ranks.rank_host``:
  line rank // ``LOCAL_WORLD_SIZE`` of the launcher's host file, ``GOODPUT_HOSTFILE``, when it
  is set; else this machine's host name), cut at the first dot.
- ``ckpt-kill``: in the first checkpoint save of a step >= ``step``, the rank SIGKILLs itself
  while writing it: after its files of that checkpoint are written, before ``.complete`` can
  exist (in the background flush, or in the synchronous write when the save is synchronous).
- ``save-fail``: in that same save, this rank's write raises ``OSError(ENOSPC)``.
- ``snapshot-kill``: in the first in-memory checkpoint of a step >= ``step`` on this rank, the rank
  SIGKILLs itself in the snapshot's background write (``on_snapshot_write``): after the payload
  is copied, before its manifest is written, so that snapshot is half-written and must never be
  loaded.
- ``host-loss``: once step ``step`` has completed (as ``kill``), the rank first calls
  ``FaultPlan.host_loss_hook`` (the trainer sets it to the snapshot store's ``forget_host``,
  which removes this host's snapshot folder: the host's memory is gone; None: nothing to
  forget), then dies as ``bad-node`` does (the same line, exit 1), so the launcher replaces the
  host with a spare and the rank's state must come back from its partner's copy.
- ``nan``: at step ``step``, after backward and before the gradients are reduced and their norm
  checked, one element of this rank's gradients becomes NaN. Every time that step runs: a
  resumed run replays it, and a reference run given the same ``nan`` faults skips the same steps.
- ``slow`` (``seconds``: 0 < s <= 600; ``steps``: the window's length, >= 1): a straggler. On
  every step of ``[step, step + steps)``, just before the step's work (``before_step``), the
  rank sleeps ``seconds``; every time such a step runs, replays included. Its peers wait for it
  in the step's first collective, so the time counts as this rank's busy time alone.
- ``stall`` (``where``: ``data`` or ``collective``): a rank that stops making progress but stays
  alive, unlike ``hang`` (its process keeps running and answers a stack dump). ``data``: in the
  data phase of step ``step`` (``before_data``) it sleeps for ever, as a rank stuck reading its
  batch; ``collective``: just before the step's first collective (``before_step``) it blocks for
  ever, as a rank that never joins the collective its peers wait in. The launcher's watchdog
  ends the attempt; it fires once, so the resumed attempt gets past it.

Fire once: right before a fault fires, ``fired_dir/<id>.json`` is written atomically, ``{"id",
"kind", "step" (the step it fired at), "rank", "time"}``; a fault whose record exists never
fires again, so a resumed run is not killed twice by one fault. ``nan`` and ``slow`` record
their first firing only, and keep firing.

Standard library only: ``train`` and ``checkpoint`` import this module; it imports neither of
them, nor ``launch``, nor torch.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from goodput.errors import GoodputError
from goodput.io import read_bytes, write_json
from goodput.ranks import FAULTS_VAR, rank_host

KINDS = (
    "kill", "ckpt-kill", "hang", "bad-node", "save-fail", "nan", "slow", "stall",
    "snapshot-kill", "host-loss",
)  # fmt: skip
AFTER_STEP = ("kill", "hang", "bad-node", "host-loss")
IN_SAVE = ("ckpt-kill", "save-fail")
IN_SNAPSHOT = ("snapshot-kill",)
NEEDS_SNAPSHOTS = ("snapshot-kill", "host-loss")  # refused in a run without snapshots
DEVICE_LOST = ("bad-node", "host-loss")  # die with the device-error line the launcher evicts on
STALL_WHERE = ("data", "collective")
MAX_SLOW_S = 600.0
MAX_PLAN_BYTES = 1 << 20
MAX_FAULTS = 10_000
MAX_ID = 2**31 - 1
MAX_STEP = 2**53
MAX_RANK = 10_000_000 - 1  # launch.env's MAX_RANKS - 1: far past any machine
MAX_PATH_CHARS = 4096
PLAN_KEYS = frozenset({"fired_dir", "faults"})
FAULT_KEYS = frozenset({"id", "kind", "step", "rank"})  # every kind's
KIND_KEYS = {"slow": frozenset({"seconds", "steps"}), "stall": frozenset({"where"})}  # its own
INJECTED = "(injected by goodput chaos)"


@dataclass(frozen=True, slots=True)
class Fault:
    """One planned fault; the last three are the keys of ``slow`` and ``stall`` (None on the
    kinds that do not take them)."""

    id: int
    kind: str
    step: int
    rank: int
    seconds: float | None = None  # slow: the sleep per step
    steps: int | None = None  # slow: the window's length, from ``step``
    where: str | None = None  # stall: data | collective

    def keys(self) -> dict[str, Any]:
        """The fault as its plan entry: the four keys and those of its kind."""
        return {
            "id": self.id,
            "kind": self.kind,
            "step": self.step,
            "rank": self.rank,
            **{key: getattr(self, key) for key in sorted(KIND_KEYS.get(self.kind, ()))},
        }

    def in_window(self, step: int) -> bool:
        """Whether a ``slow`` fault fires at ``step``: in ``[self.step, self.step + steps)``."""
        return self.steps is not None and self.step <= step < self.step + self.steps


class FaultPlan:
    """The faults of one run, indexed for the hooks: a dict lookup per step."""

    def __init__(self, faults: list[Fault], fired_dir: Path, environ: Mapping[str, str]):
        self.faults, self.fired_dir = faults, fired_dir
        self.source = environ.get(FAULTS_VAR, "")  # the plan file, for errors
        # As at start: it names this rank's host (ranks.rank_host), for the device-lost line.
        self.environ = dict(environ)
        self.by_step: dict[tuple[int, int], list[Fault]] = {}  # (step, rank): at that step
        self.in_save: dict[int, list[Fault]] = {}  # rank: its save faults, by step
        self.in_snapshot: dict[int, list[Fault]] = {}  # rank: its snapshot faults, by step
        self.slow: dict[int, list[Fault]] = {}  # rank: its slow faults (windows), by step
        for fault in sorted(faults, key=lambda f: (f.step, f.id)):
            if fault.kind in IN_SAVE:
                self.in_save.setdefault(fault.rank, []).append(fault)
            elif fault.kind in IN_SNAPSHOT:
                self.in_snapshot.setdefault(fault.rank, []).append(fault)
            elif fault.kind == "slow":
                self.slow.setdefault(fault.rank, []).append(fault)
            else:
                self.by_step.setdefault((fault.step, fault.rank), []).append(fault)
        self.fired: set[int] = set()  # ids known to have fired: their record exists
        # host-loss's first act: forget this host's in-memory checkpoints (the trainer sets it to
        # its snapshot store's forget_host; None: a run without snapshots has nothing to forget).
        self.host_loss_hook: Callable[[], None] | None = None

    def check_reachable(self, *, world_size: int, steps: int, saves: bool, snapshots: bool) -> None:
        """Refuse, naming its entry, a fault that could never fire in a run of ``steps`` steps
        on ``world_size`` ranks that saves checkpoints periodically or not (``saves``) and takes
        in-memory checkpoints or not (``snapshots``): a rank beyond the world, a step beyond the
        run, a save fault in a run that never saves, a snapshot fault in a run without snapshots.
        Called at start, by every rank alike, before any work."""
        for index, fault in enumerate(self.faults):
            where = f"faults[{index}] (id {fault.id}, {fault.kind})"
            if fault.rank >= world_size:
                what = f"{where}: rank {fault.rank} is not below the world size {world_size}"
            elif fault.step > steps:
                what = f"{where}: step {fault.step} is after the run's last (train.steps = {steps})"
            elif fault.kind in IN_SAVE and not saves:
                what = (
                    f"{where}: the run saves no checkpoints (checkpoint.interval_steps and "
                    "interval_minutes are 0)"
                )
            elif fault.kind in NEEDS_SNAPSHOTS and not snapshots:
                what = (
                    f"{where}: the run takes no memory snapshots "
                    "(checkpoint.memory_interval_steps is 0)"
                )
            else:
                continue
            raise _refused(self.source, f"{what}, so it would never fire")

    def after_step(self, step: int, rank: int) -> None:
        """Called once step ``step`` is over (metrics written, checkpoint decided): kill, stop
        or fail this rank if a fault says so."""
        for fault in self.by_step.get((step, rank), ()):
            if fault.kind in AFTER_STEP and self._claim(fault, step):
                self._fire(fault, rank)

    def before_data(self, step: int, rank: int) -> None:
        """Called in the data phase of step ``step``, before its batch is read: a ``stall``
        with ``where = data`` blocks this rank for ever (its first time only)."""
        for fault in self.by_step.get((step, rank), ()):
            if fault.kind == "stall" and fault.where == "data" and self._claim(fault, step):
                stall()

    def before_step(self, step: int, rank: int) -> None:
        """Called just before step ``step``'s work, before its first collective: a ``slow``
        fault whose window holds the step sleeps its ``seconds`` (every time the step runs); a
        ``stall`` with ``where = collective`` blocks this rank for ever (its first time only)."""
        for fault in self.slow.get(rank, ()):
            if fault.in_window(step) and fault.seconds is not None:
                self._claim(fault, step)  # a record the first time; it fires every time regardless
                time.sleep(fault.seconds)
        for fault in self.by_step.get((step, rank), ()):
            if fault.kind == "stall" and fault.where == "collective" and self._claim(fault, step):
                stall()

    def nan_at(self, step: int, rank: int) -> bool:
        """Whether this rank's gradients of step ``step`` get a NaN (the caller puts it in)."""
        nans = [f for f in self.by_step.get((step, rank), ()) if f.kind == "nan"]
        for fault in nans:
            self._claim(fault, step)  # a record the first time; it fires every time regardless
        return bool(nans)

    def on_checkpoint_write(self, step: int, rank: int) -> None:
        """Called by the checkpoint writer once this rank's files of the checkpoint of ``step``
        are written, before it reports them done: fail the write or kill the rank if due."""
        for fault in self.in_save.get(rank, ()):
            if fault.step <= step and self._claim(fault, step):
                if fault.kind == "save-fail":
                    raise OSError(errno.ENOSPC, f"No space left on device {INJECTED}")
                os.kill(os.getpid(), signal.SIGKILL)

    def on_snapshot_write(self, step: int, rank: int) -> None:
        """Called by the snapshot store's background write of the in-memory checkpoint of ``step``,
        once this rank's payload is copied and before its manifest is written: kill the rank if
        a ``snapshot-kill`` is due (the first snapshot of a step >= its ``step``)."""
        for fault in self.in_snapshot.get(rank, ()):
            if fault.step <= step and self._claim(fault, step):
                os.kill(os.getpid(), signal.SIGKILL)

    def _claim(self, fault: Fault, step: int) -> bool:
        """True, with its record written, if ``fault`` never fired before (in any process)."""
        record = self.fired_dir / f"{fault.id}.json"
        if fault.id in self.fired or record.exists():
            self.fired.add(fault.id)
            return False
        write_json(
            record,
            {
                "id": fault.id,
                "kind": fault.kind,
                "step": step,
                "rank": fault.rank,
                "time": time.time(),
            },
        )
        self.fired.add(fault.id)
        return True

    def _fire(self, fault: Fault, rank: int) -> None:
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)  # SIGCONT lets it go on
        else:  # DEVICE_LOST: a host-loss takes the host's memory with it first
            if fault.kind == "host-loss" and self.host_loss_hook is not None:
                self.host_loss_hook()
            host = rank_host(rank, self.environ)
            sys.stdout.flush()
            print(
                f"goodput: error: rank {rank} on {host}: CUDA error: device lost {INJECTED}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)


def stall() -> NoReturn:
    """Block for ever, alive: the rank still runs its signal handlers (a stack dump, SIGTERM's
    flag) but never goes on; the launcher's watchdog ends it."""
    while True:
        time.sleep(3600)


def load_plan(environ: Mapping[str, str]) -> FaultPlan | None:
    """The plan ``GOODPUT_FAULTS`` names, or None when it is unset or empty."""
    path = environ.get(FAULTS_VAR)
    if not path:
        return None
    if not os.path.isabs(path) or "\0" in path or len(path) > MAX_PATH_CHARS:
        raise _refused(path, "is not an absolute path")
    try:
        text = read_bytes(path, MAX_PLAN_BYTES).decode("utf-8")
        plan = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except GoodputError as exc:
        raise _refused(path, exc.what) from None
    except UnicodeDecodeError as exc:
        raise _refused(path, f"is not UTF-8 (byte {exc.start})") from None
    except ValueError as exc:
        raise _refused(path, f"is not valid JSON ({exc})") from None
    except RecursionError:
        raise _refused(path, "is JSON nested too deeply") from None
    try:
        faults, fired_dir = parse_plan(plan)
    except ValueError as exc:
        raise _refused(path, str(exc)) from None
    return FaultPlan(faults, fired_dir, environ)


def parse_plan(plan: Any) -> tuple[list[Fault], Path]:
    """(faults, fired_dir) of a decoded plan; ``ValueError`` saying what is wrong otherwise."""
    _check_keys(plan, PLAN_KEYS, "the plan")
    fired_dir = plan["fired_dir"]
    if not (
        isinstance(fired_dir, str)
        and os.path.isabs(fired_dir)
        and "\0" not in fired_dir
        and len(fired_dir) <= MAX_PATH_CHARS
    ):
        raise ValueError("fired_dir is not an absolute path")
    entries = plan["faults"]
    if not isinstance(entries, list):
        raise ValueError("faults is not a list")
    if len(entries) > MAX_FAULTS:
        raise ValueError(f"has {len(entries)} faults, more than {MAX_FAULTS}")
    faults, ids = [], set()
    for index, entry in enumerate(entries):
        where = f"faults[{index}]"
        fault = _fault(entry, where)
        if fault.id in ids:
            raise ValueError(f"{where}.id {fault.id} is used twice")
        ids.add(fault.id)
        faults.append(fault)
    return faults, Path(fired_dir)


def _fault(entry: Any, where: str) -> Fault:
    """One plan entry, checked: its kind first, then exactly the keys that kind takes."""
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind not in KINDS:
        _check_keys(entry, FAULT_KEYS, where)  # not an object, or a key unknown or missing
        raise ValueError(f"{where}.kind {_short(kind)} is not one of {', '.join(KINDS)}")
    own = KIND_KEYS.get(kind, frozenset())
    _check_keys(entry, FAULT_KEYS | own, f"{where} (kind {kind})")
    return Fault(
        id=_int_in(entry["id"], 0, MAX_ID, f"{where}.id"),
        kind=kind,
        step=_int_in(entry["step"], 1, MAX_STEP, f"{where}.step"),
        rank=_int_in(entry["rank"], 0, MAX_RANK, f"{where}.rank"),
        seconds=_seconds_in(entry["seconds"], f"{where}.seconds") if "seconds" in own else None,
        steps=_int_in(entry["steps"], 1, MAX_STEP, f"{where}.steps") if "steps" in own else None,
        where=_where_in(entry["where"], f"{where}.where") if "where" in own else None,
    )


def _seconds_in(value: Any, where: str) -> float:
    # The comparison refuses NaN and infinities too, and an int too large for a float.
    if type(value) not in (int, float) or not 0 < value <= MAX_SLOW_S:
        raise ValueError(f"{where} is {_short(value)}, not a number in (0, {MAX_SLOW_S:g}]")
    return float(value)


def _where_in(value: Any, where: str) -> str:
    if value not in STALL_WHERE:
        raise ValueError(f"{where} is {_short(value)}, not one of {', '.join(STALL_WHERE)}")
    return str(value)


def _check_keys(value: Any, keys: frozenset[str], where: str) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{where} is not a JSON object")
    unknown = sorted(set(value) - keys)
    if unknown:
        raise ValueError(f"{where} has the unknown key {unknown[0]!r}")
    missing = sorted(keys - set(value))
    if missing:
        raise ValueError(f"{where} lacks the key {missing[0]!r}")


def _int_in(value: Any, low: int, high: int, where: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{where} is {_short(value)}, not an integer in [{low}, {high}]")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("an object has a key twice")
    return dict(pairs)


def _short(value: Any) -> str:
    """A plan's value, quoted in an error: its JSON, cut short (it may be a megabyte)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _refused(path: str, what: str) -> GoodputError:
    return GoodputError.usage(
        f"{FAULTS_VAR}={path!r}",
        what,
        f"fix or rewrite the fault plan (goodput chaos writes it), or unset {FAULTS_VAR}",
    )
