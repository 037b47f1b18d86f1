"""``setup_torch()``: one call from "some launcher started me" to a ready process group.

Reads the placement (``goodput.launch.env``), picks device and backend
(``goodput.train.device``), makes the local device current *before* the process group exists
(an FSDP2 first all-gather deadlocks otherwise on some stacks), seeds every RNG with the same
seed on every rank (identical model init; data order comes from the blend, not from RNG), and
initialises the default process group with a timeout. Before that it raises the soft limit of
open files to the hard one (``open_files_to_hard_limit``): rank 0 serves the rendezvous store
to every rank and, as DCP's coordinator, ends connected to every rank on the checkpoint's group
(``checkpoint.groups``): 2 W sockets, past the usual soft limit of 1,024 from about 500 ranks,
where sites set the hard limit high. A single process gets a world-size-1 group
on an in-memory store: no port, no network. Under ``goodput launch --in-process`` the group is
the current generation's (``generation``), on the launcher's recovery store. It returns the
``Runtime``: rank, world size and device, derived here once (how the ranks split into
parallel dimensions is ``mesh.py``'s).
``decided_by_rank_zero``: a check or choice made once, on rank 0, that every rank then shares.
"""

from __future__ import annotations

import random
import resource
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from goodput.errors import GoodputError
from goodput.launch.env import current_placement
from goodput.train import generation as generations
from goodput.train.device import backend_for, detect_device_type, local_device

DEFAULT_TIMEOUT_S = 600


@dataclass(frozen=True, slots=True)
class Runtime:
    rank: int  # in the default process group
    world_size: int
    device: torch.device  # this rank's, already made current
    ranks_per_host: int  # the placement's; where the mesh keeps tensor-parallel groups


def open_files_to_hard_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (as far as the kernel
    allows: an unlimited hard limit is not a number of files); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a kernel cap below the hard limit: keep the soft one
            return soft
        return hard
    return soft


def setup_torch(seed: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S) -> Runtime:
    """Initialise this rank for training."""
    open_files_to_hard_limit()
    placement = current_placement()
    device_type = detect_device_type()
    device = local_device(device_type, placement.local_rank)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        backend = backend_for(device_type)
        device_id = device if device_type in ("cuda", "xpu") else None
        generation = generations.current()
        if generation is not None:  # goodput launch --in-process: the recovery store's groups
            dist.init_process_group(
                backend,
                store=generation.prefix_store(),
                rank=generation.rank,
                world_size=placement.world_size,
                timeout=timeout,
                device_id=device_id,
            )
            generation.joined()
        elif placement.world_size == 1:
            dist.init_process_group(
                backend,
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                timeout=timeout,
                device_id=device_id,
            )
        else:
            dist.init_process_group(
                backend,
                init_method=f"tcp://{placement.master_addr}:{placement.master_port}",
                rank=placement.rank,
                world_size=placement.world_size,
                timeout=timeout,
                device_id=device_id,
            )
    # Already initialised by the caller (a test harness, a notebook): its group is the truth,
    # and with no launcher's placement to say otherwise, its ranks share one host.
    world_size = dist.get_world_size()
    known = placement.world_size == world_size
    ranks_per_host = placement.local_world_size if known else world_size
    return Runtime(dist.get_rank(), world_size, device, ranks_per_host)


def decided_by_rank_zero(decide: Callable[[], Any]) -> Any:
    """Run ``decide`` on rank 0 only and hand its result — or its GoodputError, so that no rank
    waits out the collective timeout — to every rank."""
    found: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            found[0] = decide()
        except GoodputError as error:
            found[0] = error
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)  # our own ranks' str/None/GoodputError
    if isinstance(found[0], GoodputError):
        raise found[0]
    return found[0]
