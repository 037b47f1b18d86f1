"""goodput's own process groups beside the training mesh: gloo groups of the whole world whose
pairs of ranks connect on first use (``lazy_gloo_group``), made by the checkpointer (its flush)
and the snapshot store (its exchange).

Why not as torch makes them. A gloo group made as ``new_group(backend="gloo")`` makes it
connects every pair of its ranks at once (a full mesh): W - 1 sockets and a listening one on
every rank, per group, and every rank reads every other rank's store entry (W reads a rank,
each entry carrying W pair numbers: about 8 W^2 bytes a rank through the one rendezvous store).
Users of gloo see that set-up fail past about a thousand ranks (pytorch/gloo#327,
NVIDIA/Megatron-LM#877); torch 2.8 added connecting on first use for it (pytorch/pytorch#150801,
pytorch/gloo#419). Made lazily, a group opens its listening socket and writes this rank's store
entry, nothing else; a pair connects (one store read) when its two ranks first exchange a
message.

What a rank then holds is the union of the peers of the collectives run on the group. Measured
on torch 2.13's gloo (``benchmarks/bench_control.py``, section ``groups``):

- ``all_reduce``, ``all_gather`` (and the object collectives' sizes, which go first by
  ``all_gather``): its two ring neighbours;
- ``barrier``: a dissemination barrier, the ranks at distances 1, 2, 4, ... either way
  (2 ceil(log2 W) - 1 peers);
- ``broadcast`` (``broadcast_object_list``): its parent and children in a binomial tree (at
  most ceil(log2 W) peers, the root's);
- ``gather``, ``scatter`` (``gather_object``, ``scatter_object_list``): the root to every rank
  (W - 1 on the root, one on the others);
- ``send``/``recv``: the one peer.

How. torch 2.13's ``new_group`` hands gloo no options (``pg_options`` is ignored for gloo);
gloo reads ``TORCH_GLOO_LAZY_INIT`` each time a group is made
(``ProcessGroupGloo::Options::create_default``), so it is set for the one call and put back as
it was: the default group and the training mesh's groups connect as before. Setting the
environment races a C ``getenv`` on another thread; these groups are made at start-up, from the
main thread, while goodput's only other thread (the checkpoint's checksums, ``verify``) reads
no environment. A peer lost before its pair connects: in three tries here the survivor's
collective failed ("Connect timeout" after five times the group's timeout, or "Connection reset
by peer") or the rank aborted; pytorch/gloo#520 reports a hang in that case on a newer gloo
(fixed by pytorch/gloo#521). The launcher's watchdog ends such an attempt either way.

Under ``goodput launch --in-process`` (``ranks.RECOVERY_STORE_VAR`` set) the groups connect at
once instead, as torch makes them: there a rank that outlives a dead peer must tear its groups
down and go on, and a pair still connecting when the peer died kept the survivor's teardown
waiting for ever (seen here at a kill during a checkpoint's flush: ``~ProcessGroupGloo`` joined
a gloo event loop that never went idle). The local launcher, the only one that keeps spares,
runs a handful of ranks, for which a full mesh costs nothing.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from goodput.ranks import RECOVERY_STORE_VAR

LAZY_INIT_VAR = "TORCH_GLOO_LAZY_INIT"


def lazy_gloo_group(timeout: timedelta | None = None) -> dist.ProcessGroup:
    """Collective (every rank, same moment): a new gloo group of every rank of the default group,
    each pair connected when it first exchanges a message; under in-process recovery, every pair
    at once (the module docstring)."""
    if RECOVERY_STORE_VAR in os.environ:
        return dist.new_group(backend="gloo", timeout=timeout)
    before = os.environ.get(LAZY_INIT_VAR)
    os.environ[LAZY_INIT_VAR] = "1"
    try:
        return dist.new_group(backend="gloo", timeout=timeout)
    finally:
        if before is None:
            del os.environ[LAZY_INIT_VAR]
        else:
            os.environ[LAZY_INIT_VAR] = before
