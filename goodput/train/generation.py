"""The generation of process groups this process trains in, under ``goodput launch --in-process``
(``recovery``): which prefix of the launcher's recovery store ``setup_torch`` initialises the
default group on, and the word back that it is up. None, without ``--in-process``: the groups
are the launcher's rendezvous as always."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Generation:
    number: int
    store: dist.Store  # the recovery store's client; the groups use ``gen/NUMBER/`` in it
    rank: int

    def prefix_store(self) -> dist.PrefixStore:
        return dist.PrefixStore(f"gen/{self.number}/", self.store)

    def joined(self) -> None:
        """This rank's default group of the generation is up: said to the launcher (its
        ``joined/NUMBER/RANK``, counted in ``joined/NUMBER``), which times the rendezvous by it."""
        self.store.set(f"joined/{self.number}/{self.rank}", str(os.getpid()))
        self.store.add(f"joined/{self.number}", 1)


_current: Generation | None = None


def enter(generation: Generation) -> None:
    global _current
    _current = generation


def leave() -> None:
    global _current
    _current = None


def current() -> Generation | None:
    """The generation ``setup_torch`` initialises on; None without ``--in-process``."""
    return _current
