"""Placement: who and where this process is, read from whatever launched it.

The sole reader of scheduler and launcher variables (``SLURM_*``, ``PBS_*``, ``PMI_*``,
``PALS_*``, ``OMPI_*``, torchrun's ``RANK``/``WORLD_SIZE``/...). ``read_placement`` is a pure
function of an environment mapping and a hostfile's text, so every launcher is testable without
a cluster. Rank variables are read in a fixed order — torchrun, MPI/PMI (MPICH, Cray PALS),
Open MPI, a Slurm job step — and the first complete set wins; with none, this is a single
process. Host names are validated, never passed to a shell.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from goodput.errors import GoodputError

HOSTNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
DEFAULT_PORT = 29500
PORT_SPREAD = 2000  # jobs sharing a node get different ports, derived from the job id

# (source, rank, world size, local rank, local world size): the first source whose rank and
# world size are both set is used.
RANK_SOURCES = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"),
    ("pals", "PALS_RANKID", "PMI_SIZE", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE"),
    (
        "ompi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)
# MPICH's Hydra names local ranks its own way.
LOCAL_RANK_FALLBACKS = ("MPI_LOCALRANKID", "MPICH_LOCALRANKID")
LOCAL_SIZE_FALLBACKS = ("MPI_LOCALNRANKS", "MPICH_LOCALNRANKS")


@dataclass(frozen=True, slots=True)
class Placement:
    scheduler: str  # "slurm" | "pbs" | "local"
    job_id: str | None
    hosts: tuple[str, ...]
    source: str  # which launcher's variables gave the rank; "single" for none
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def read_placement(env: Mapping[str, str], hostfile_text: str | None = None) -> Placement:
    """The placement described by ``env`` (and, under PBS, the ``PBS_NODEFILE`` contents)."""
    scheduler, job_id, hosts = _allocation(env, hostfile_text)
    source, rank, world_size, local_rank, local_world_size = _ranks(env, len(hosts))
    master_addr = env.get("MASTER_ADDR") or (hosts[0] if len(hosts) > 1 else "127.0.0.1")
    check_host(master_addr, "MASTER_ADDR")
    return Placement(
        scheduler,
        job_id,
        hosts,
        source,
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        _port(env, job_id),
    )


def launcher_rank(env: Mapping[str, str]) -> tuple[int, int]:
    """``RANK``/``WORLD_SIZE`` alone, as torchrun and ``goodput launch`` set them, for jobs that
    split work by rank without a process group (``goodput data tokenize``). Scheduler variables
    are deliberately ignored: inside a Slurm batch script ``SLURM_NTASKS`` describes the whole
    allocation, and a lone process reading it would do only its share of the work."""
    values = {key: env.get(key, default) for key, default in (("RANK", "0"), ("WORLD_SIZE", "1"))}
    try:
        return int(values["RANK"]), int(values["WORLD_SIZE"])
    except ValueError:
        raise GoodputError.usage(
            "environment",
            f"RANK={values['RANK']!r} WORLD_SIZE={values['WORLD_SIZE']!r} are not integers",
            "unset them or let the launcher set them",
        ) from None


def expand_nodelist(spec: str) -> list[str]:
    """Expand a Slurm node list such as ``x[1000-1003,1010]c0s1b0n0,login[1-2]``."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", spec):
        hosts += _expand_item(item, spec)
    for host in hosts:
        check_host(host, "SLURM_JOB_NODELIST")
    return hosts


def _expand_item(item: str, spec: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    expanded = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise GoodputError(
                "SLURM_JOB_NODELIST",
                f"cannot expand {spec!r}",
                "check the node list the scheduler set",
            )
        for number in range(int(low), int(high or low) + 1):
            expanded += _expand_item(f"{head}{number:0{len(low)}d}{tail}", spec)
    return expanded


def _allocation(
    env: Mapping[str, str], hostfile_text: str | None
) -> tuple[str, str | None, tuple[str, ...]]:
    if "SLURM_JOB_ID" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        return "slurm", env["SLURM_JOB_ID"], tuple(expand_nodelist(nodelist))
    if "PBS_JOBID" in env:
        if hostfile_text is None:
            raise GoodputError(
                "PBS_NODEFILE",
                "the PBS host file could not be read",
                "run inside a PBS job, where PBS_NODEFILE names a readable file",
            )
        hosts = tuple(
            dict.fromkeys(line.strip() for line in hostfile_text.splitlines() if line.strip())
        )
        for host in hosts:
            check_host(host, "PBS_NODEFILE")
        return "pbs", env["PBS_JOBID"], hosts
    return "local", None, ("localhost",)


def _ranks(env: Mapping[str, str], num_hosts: int) -> tuple[str, int, int, int, int]:
    for source, rank_key, size_key, local_key, local_size_key in RANK_SOURCES:
        if rank_key in env and size_key in env:
            rank, world_size = _int(env, rank_key), _int(env, size_key)
            local_rank = _first_int(env, (local_key, *LOCAL_RANK_FALLBACKS))
            local_size = _first_int(env, (local_size_key, *LOCAL_SIZE_FALLBACKS))
            per_host = max(world_size // max(num_hosts, 1), 1)
            if not 0 <= rank < world_size:
                raise GoodputError.usage(
                    rank_key,
                    f"rank {rank} is outside a world of {world_size}",
                    "check the launcher's variables",
                )
            return (
                source,
                rank,
                world_size,
                rank % per_host if local_rank is None else local_rank,
                per_host if local_size is None else local_size,
            )
    return "single", 0, 1, 0, 1


def _int(env: Mapping[str, str], key: str) -> int:
    # Slurm writes per-node task counts like "4(x2)"; the leading count is this node's.
    text = env[key].split("(")[0]
    if not text.isdigit():
        raise GoodputError.usage(
            key,
            f"{env[key]!r} is not a count",
            "check the launcher's variables",
        )
    return int(text)


def _first_int(env: Mapping[str, str], keys: tuple[str, ...]) -> int | None:
    return next((_int(env, key) for key in keys if key in env), None)


def _port(env: Mapping[str, str], job_id: str | None) -> int:
    if "MASTER_PORT" in env:
        return _int(env, "MASTER_PORT")
    if job_id is None:
        return DEFAULT_PORT
    # Every rank of a job derives the same port; two jobs on one node rarely collide.
    return DEFAULT_PORT + int(hashlib.sha256(job_id.encode()).hexdigest(), 16) % PORT_SPREAD


def check_host(host: str, where: str) -> None:
    if not HOSTNAME.match(host):
        raise GoodputError(
            where,
            f"{host!r} is not a valid host name",
            "fix the host list; names are letters, digits, '.', '-', '_'",
        )


def current_placement() -> Placement:
    """``read_placement`` of this process's environment, the PBS host file read if named."""
    nodefile = os.environ.get("PBS_NODEFILE")
    hostfile_text = Path(nodefile).read_text() if nodefile and Path(nodefile).is_file() else None
    return read_placement(os.environ, hostfile_text)
