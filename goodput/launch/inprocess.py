"""In-process recovery, the launcher's side (``goodput launch --in-process [--spares-warm N]``;
the rank's side and the store's keys are ``goodput.train.recovery``'s).

The launcher hosts the recovery store (torch's ``TCPStore``: this module imports torch, only
when ``--in-process`` asks for it; the rest of ``goodput.launch`` stays torch-free), starts the
ranks and ``N`` warm spares, and when a rank's process dies:

  1. abort: sets every rank's ``wake/g/RANK`` to ``abort`` (one ``multi_set``); every rank of
     generation g leaves its step and says so (``left/g/RANK``); a spare is given the dead rank
     (``spare/ID``);
  2. rendezvous: answers ``next/g`` with generation g + 1; every rank, the spare too, builds the
     new default group on it (``joined/g+1/RANK``);
  3. the ranks then restore the newest in-memory checkpoint and take the next step (their
     metrics records time both), and a new warm spare is started so ``N`` stay warm.

It falls back to today's full restart, saying why, when no warm spare is alive, when a rank or
the spare dies during the recovery, or when the ranks have not left or joined within
``timeout_s``: ``next/g`` then says ``fallback`` and the attempt ends as without
``--in-process``. Only the local launcher keeps spares in this version: under srun or mpiexec
one launcher step owns every rank, and a rank's death ends the step.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from goodput.ranks import RECOVERY_STORE_VAR, SPARE_VAR

LOCAL_ADDR = "127.0.0.1"
POLL_S = 0.005  # the store is on this host: a check costs ~0.1 ms
DEFAULT_TIMEOUT_S = 60.0  # --recovery-timeout's default


@dataclass(frozen=True, slots=True)
class Recovered:
    """One in-process recovery as the launcher timed it."""

    rank: int
    spare: int
    generation: int  # the new one
    abort_s: float  # the death seen -> every survivor left its step
    rendezvous_s: float  # -> every rank's new default group up


@dataclass(frozen=True, slots=True)
class Fallback:
    """Why an in-process recovery gave up, and the death it was for (its exit code, its label)."""

    why: str
    rank: int
    code: int = 1
    label: str | None = None


class InProcess:
    """The recovery store, the warm spares and the recovery of one launch."""

    def __init__(self, spares_warm: int, timeout_s: float):
        import torch.distributed as dist  # only under --in-process: see the module docstring

        self.store = dist.TCPStore(LOCAL_ADDR, 0, is_master=True, wait_for_workers=False)
        self.spares_warm, self.timeout_s = spares_warm, timeout_s
        self.generation = 0
        self.next_spare = 0
        self.spares: dict[int, subprocess.Popen[bytes]] = {}  # id -> process, not yet given
        self.seen: float | None = None  # when the death being recovered was seen (``abort``)

    def rank_env(self) -> dict[str, str]:
        return {RECOVERY_STORE_VAR: f"{LOCAL_ADDR}:{self.store.port}"}

    def spare_env(self, rank_env: dict[str, str]) -> tuple[int, dict[str, str]]:
        """A new warm spare's number and environment: a rank's, with no rank yet."""
        spare = self.next_spare
        self.next_spare += 1
        env = {key: value for key, value in rank_env.items() if key not in ("RANK", "LOCAL_RANK")}
        return spare, env | {SPARE_VAR: str(spare)}

    def recover(
        self,
        dead_rank: int,
        ranks: list[subprocess.Popen[bytes]],
        notice: Callable[[str], None],
        interrupted: Callable[[], bool] = lambda: False,
    ) -> Recovered | Fallback:
        """Recover generation g from ``dead_rank``'s death (``ranks``: every rank's process, in
        rank order, the dead one included); the outcome, said to the ranks too.
        ``interrupted``: the launcher got SIGINT or SIGTERM, which ends the waits at once."""
        if self.seen is None:
            self.abort(len(ranks))
        g, seen = self.generation, self.seen
        self.seen = None
        assert seen is not None
        spare = next((i for i, p in sorted(self.spares.items()) if p.poll() is None), None)
        if spare is None:
            return self._fall_back(g, dead_rank, "no warm spare is alive")
        process = self.spares.pop(spare)
        self.store.set(f"spare/{spare}", json.dumps({"rank": dead_rank, "generation": g + 1}))
        notice(f"launch: rank {dead_rank} died; spare {spare} takes its place (generation {g + 1})")
        survivors = [r for r in range(len(ranks)) if r != dead_rank]
        others = [p for r, p in enumerate(ranks) if r != dead_rank] + [process]
        failed = self._wait_keys(f"left/{g}", survivors, others, "leave its step", interrupted)
        if failed is not None:
            return self._fall_back(g, dead_rank, failed, process)
        left = time.monotonic()
        self.store.set(f"next/{g}", json.dumps({"generation": g + 1}))
        every = list(range(len(ranks)))
        joining = f"join generation {g + 1}"
        failed = self._wait_keys(f"joined/{g + 1}", every, others, joining, interrupted)
        if failed is not None:
            return self._fall_back(g + 1, dead_rank, failed, process)
        self.generation = g + 1
        ranks[dead_rank] = process
        return Recovered(dead_rank, spare, g + 1, left - seen, time.monotonic() - left)

    def abort(self, world_size: int) -> None:
        """Wake every rank's watcher of this generation with ``abort`` (one request): called
        the moment a death is seen, so the ranks leave their step while the launcher records
        the attempt; ``recover`` then goes on from there."""
        keys = [f"wake/{self.generation}/{rank}" for rank in range(world_size)]
        self.store.multi_set(keys, ["abort"] * world_size)  # type: ignore[attr-defined]
        self.seen = time.monotonic()

    def _wait_keys(
        self,
        count: str,
        ranks: list[int],
        alive: list[subprocess.Popen[bytes]],
        what: str,
        interrupted: Callable[[], bool],
    ) -> str | None:
        """None once every rank of ``ranks`` has counted itself in ``count`` (one counter read a
        poll, whatever the world size); else why not: a process died, or ``timeout_s`` passed,
        naming the first rank whose own key ``count/RANK`` is missing."""
        deadline = time.monotonic() + self.timeout_s
        while self.store.add(count, 0) < len(ranks):
            if interrupted():
                return "the launcher was interrupted"
            dead = next((p for p in alive if p.poll() is not None), None)
            if dead is not None:
                code = dead.returncode
                return f"a second failure during the recovery (pid {dead.pid} exited {code})"
            if time.monotonic() > deadline:
                missing = [f"{count}/{r}" for r in ranks if not self.store.check([f"{count}/{r}"])]
                within = f"within {self.timeout_s:g} s"
                return f"{len(missing)} rank(s) did not {what} {within} ({missing[0]})"
            time.sleep(POLL_S)
        return None

    def _fall_back(
        self, g: int, rank: int, why: str, spare: subprocess.Popen[bytes] | None = None
    ) -> Fallback:
        """Tell generation ``g``'s ranks to exit; the attempt then ends as without recovery."""
        self.store.set(f"next/{g}", json.dumps({"fallback": why}))
        if spare is not None:  # given the rank, in no attempt's list yet: stopped and reaped here
            spare.kill()
            spare.wait()
        return Fallback(why, rank)
