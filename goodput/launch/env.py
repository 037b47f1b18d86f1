"""Placement: who and where this process is, read from whatever launched it.

The sole reader of scheduler and launcher variables (``SLURM_*``, ``PBS_*``, ``PMI_*``,
``PALS_*``, ``OMPI_*``, torchrun's ``RANK``/``WORLD_SIZE``/...) and of host files.
``read_placement`` is a pure function of an environment mapping and a hostfile's text, so every
launcher is testable without a cluster. Rank variables are read in a fixed order — torchrun,
MPI/PMI (MPICH, Cray PALS), Open MPI, a Slurm job step — and the first complete set wins; with
none, this is a single process.
Invariants: everything read is parsed strictly and bounded. Host names are matched whole and
never passed to a shell; a node list is counted before it is expanded, and refused above
``MAX_HOSTS`` without building the list; host files are read bounded, strict UTF-8, and a bad
name is named by file:line; every number is checked for form and range, naming its variable.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from goodput.errors import GoodputError
from goodput.io import read_text
from goodput.ranks import HOSTNAME, MAX_HOST_CHARS, MAX_HOSTS

JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\[\]-]{0,127}")  # Slurm 123, PBS 123[4].server
DEFAULT_PORT = 29500
PORT_SPREAD = 2000  # jobs sharing a node get different ports, derived from the job id
MAX_RANKS = 100 * MAX_HOSTS
MAX_HOSTFILE_LINES = 10 * MAX_HOSTS  # a PBS node file names each host once per rank
MAX_HOSTFILE_BYTES = 64 * MAX_HOSTFILE_LINES
# Numbers have at most 18 digits: far past any real one, and int() of them stays cheap.
COUNT = re.compile(r"[0-9]{1,18}")
# Slurm's per-node task counts: "4", "4(x2)", "2(x3),1"; the leading count is this node's.
TASKS_PER_NODE = re.compile(
    r"([0-9]{1,18})(?:\(x[0-9]{1,18}\))?(?:,[0-9]{1,18}(?:\(x[0-9]{1,18}\))?)*"
)
NODE_RANGE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?")
# A node list's tokens: a run of name characters, a whole bracket group, or a lone "[", "]", ",".
NODELIST_TOKEN = re.compile(r"[^\[\],]+|\[[^\[\]]*\]|[\[\],]")

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
    allocation, and a lone process reading it would do only its share of the work. The range of
    the rank is the caller's to check, against what it does with it."""
    values = {key: env.get(key, default) for key, default in (("RANK", "0"), ("WORLD_SIZE", "1"))}
    if not all(COUNT.fullmatch(value) for value in values.values()):
        raise GoodputError.usage(
            "environment",
            f"RANK={values['RANK']!r} WORLD_SIZE={values['WORLD_SIZE']!r} are not integers",
            "unset them or let the launcher set them",
        )
    return _number(values, "RANK", 0, MAX_RANKS - 1), _number(values, "WORLD_SIZE", 1, MAX_RANKS)


def expand_nodelist(spec: str, where: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand a Slurm node list such as ``x[1000-1003,1010]c0s1b0n0,login[1-2]``.

    Names are separated by commas; each is literal text and bracket groups of numbers and
    ``low-high`` ranges (zero-padded to the width of ``low``), every group multiplying the
    names. Brackets do not nest. The hosts are counted first and refused above ``MAX_HOSTS``.
    """
    names = _parse_nodelist(spec, where)
    num_hosts = 0
    for literals, groups in names:
        if _longest_name(literals, groups) > MAX_HOST_CHARS:
            raise GoodputError(
                where,
                f"makes names longer than {MAX_HOST_CHARS} characters",
                "check the node list the scheduler set",
            )
        num_hosts += _count_names(groups, MAX_HOSTS - num_hosts)
        if num_hosts > MAX_HOSTS:
            raise GoodputError(
                where,
                f"names more than {MAX_HOSTS:,} hosts",
                "check the node list the scheduler set; goodput runs on at most that many",
            )
    hosts = [host for literals, groups in names for host in _names(literals, groups)]
    return _unique_hosts(hosts, where)


# A parsed node-list entry: its literal pieces (one more than its groups) and its bracket groups,
# each a list of (low, high, width) ranges.
_Entry = tuple[list[str], list[list[tuple[int, int, int]]]]


def _parse_nodelist(spec: str, where: str) -> list[_Entry]:
    """Split ``spec`` into entries by its tokens (each character is read once)."""
    if not spec:
        raise GoodputError(where, "is empty or not set", "check the job's node list")
    entries: list[_Entry] = []
    literals: list[str] = [""]
    groups: list[list[tuple[int, int, int]]] = []
    for token in NODELIST_TOKEN.finditer(spec + ","):
        text, position = token[0], token.start()
        if text == ",":
            if not groups and not literals[0]:
                raise _bad_nodelist(where, spec, position, "an empty name")
            entries.append((literals, groups))
            literals, groups = [""], []
        elif text.startswith("[") and text.endswith("]"):
            groups.append(_parse_group(text[1:-1], spec, position, where))
            literals.append("")
        elif text in "[]":  # a bracket without its partner, or one inside another
            raise _bad_nodelist(where, spec, position, f"an unmatched or nested {text!r}")
        else:
            literals[-1] += text
    return entries


def _parse_group(body: str, spec: str, position: int, where: str) -> list[tuple[int, int, int]]:
    ranges = []
    for part in body.split(","):
        match = NODE_RANGE.fullmatch(part)
        if match is None:
            raise _bad_nodelist(where, spec, position, f"[{body}] is not numbers and ranges")
        low, high = int(match[1]), int(match[2] or match[1])
        if low > high:
            raise _bad_nodelist(where, spec, position, f"the range {part} runs backwards")
        ranges.append((low, high, len(match[1])))
    return ranges


def _bad_nodelist(where: str, spec: str, position: int, what: str) -> GoodputError:
    shown = spec if len(spec) <= 80 else spec[:77] + "..."
    return GoodputError(
        where,
        f"cannot expand {shown!r}: {what} at character {position + 1}",
        "check the node list the scheduler set",
    )


def _longest_name(literals: list[str], groups: list[list[tuple[int, int, int]]]) -> int:
    widths = (max(max(width, len(str(high))) for _, high, width in ranges) for ranges in groups)
    return sum(map(len, literals)) + sum(widths)


def _count_names(groups: list[list[tuple[int, int, int]]], room: int) -> int:
    """How many names the groups make, or any number above ``room`` once it is exceeded."""
    count = 1
    for ranges in groups:
        count *= sum(high - low + 1 for low, high, _ in ranges)
        if count > room:
            return count
    return count


def _names(literals: list[str], groups: list[list[tuple[int, int, int]]]) -> Iterator[str]:
    choices = [
        [f"{n:0{width}d}" for low, high, width in ranges for n in range(low, high + 1)]
        for ranges in groups
    ]
    for numbers in itertools.product(*choices):
        yield "".join(
            piece
            for pair in itertools.zip_longest(literals, numbers, fillvalue="")
            for piece in pair
        )


def parse_hostfile(text: str, where: str) -> list[str]:
    """Host names of a host file's text: one a line, '#' starts a comment, blank lines and
    repeats dropped (a PBS node file names a host once per rank). A bad name is named by
    ``where``:line."""
    if text.count("\n") > MAX_HOSTFILE_LINES:
        raise GoodputError(
            where,
            f"has more than {MAX_HOSTFILE_LINES:,} lines",
            "pass the right file; a host file names each host once per rank at most",
        )
    hosts: dict[str, None] = {}
    for number, line in enumerate(text.split("\n"), 1):
        name = line.split("#", 1)[0].strip()
        if name:
            check_host(name, f"{where}:{number}")
            hosts[name] = None
    if len(hosts) > MAX_HOSTS:
        raise GoodputError(where, f"names more than {MAX_HOSTS:,} hosts", "pass the right file")
    return list(hosts)


def read_hostfile(path: str | os.PathLike[str]) -> list[str]:
    """``parse_hostfile`` of the file at ``path``: read bounded, strict UTF-8."""
    return parse_hostfile(read_text(path, MAX_HOSTFILE_BYTES), str(path))


def _unique_hosts(hosts: list[str], where: str) -> list[str]:
    seen: set[str] = set()
    for host in hosts:
        check_host(host, where)
        if host in seen:
            raise GoodputError(where, f"names {host} twice", "check the job's node list")
        seen.add(host)
    return hosts


def _allocation(
    env: Mapping[str, str], hostfile_text: str | None
) -> tuple[str, str | None, tuple[str, ...]]:
    if "SLURM_JOB_ID" in env:
        where = "SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in env else "SLURM_NODELIST"
        hosts = expand_nodelist(env.get(where, ""), where)
        return "slurm", _job_id(env, "SLURM_JOB_ID"), _some(hosts, where)
    if "PBS_JOBID" in env:
        if hostfile_text is None:
            raise GoodputError(
                "PBS_NODEFILE",
                "the PBS host file could not be read",
                "run inside a PBS job, where PBS_NODEFILE names a readable file",
            )
        where = env.get("PBS_NODEFILE") or "PBS_NODEFILE"
        hosts = parse_hostfile(hostfile_text, where)
        return "pbs", _job_id(env, "PBS_JOBID"), _some(hosts, where)
    return "local", None, ("localhost",)


def _some(hosts: list[str], where: str) -> tuple[str, ...]:
    if not hosts:
        raise GoodputError(where, "names no host", "check the job's host list")
    return tuple(hosts)


def _job_id(env: Mapping[str, str], key: str) -> str:
    # It names files and folders (launch-JOBID) and seeds the port: no separators, no "..".
    if not JOB_ID.fullmatch(env[key]):
        raise GoodputError.usage(
            key, f"{env[key]!r} is not a job id", "check the scheduler's variables"
        )
    return env[key]


def _ranks(env: Mapping[str, str], num_hosts: int) -> tuple[str, int, int, int, int]:
    for source, rank_key, size_key, local_key, local_size_key in RANK_SOURCES:
        if rank_key in env and size_key in env:
            world_size = _number(env, size_key, 1, MAX_RANKS)
            rank = _number(env, rank_key, 0, MAX_RANKS)
            local_rank = _first_number(env, (local_key, *LOCAL_RANK_FALLBACKS), 0)
            local_size = _first_number(env, (local_size_key, *LOCAL_SIZE_FALLBACKS), 1)
            per_host = max(world_size // max(num_hosts, 1), 1)
            if not rank < world_size:
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


def _number(env: Mapping[str, str], key: str, low: int, high: int) -> int:
    """``env[key]`` as a whole number in [low, high]; anything else is refused, naming ``key``."""
    text = env[key]
    match = (TASKS_PER_NODE if key == "SLURM_NTASKS_PER_NODE" else COUNT).fullmatch(text)
    if match is None:
        raise GoodputError.usage(key, f"{text!r} is not a count", "check the launcher's variables")
    value = int(match[1] if match.re is TASKS_PER_NODE else match[0])
    if not low <= value <= high:
        raise GoodputError.usage(
            key, f"{value} is not in [{low}, {high}]", "check the launcher's variables"
        )
    return value


def _first_number(env: Mapping[str, str], keys: tuple[str, ...], low: int) -> int | None:
    return next((_number(env, key, low, MAX_RANKS) for key in keys if key in env), None)


def _port(env: Mapping[str, str], job_id: str | None) -> int:
    if "MASTER_PORT" in env:
        return _number(env, "MASTER_PORT", 1, 65535)
    if job_id is None:
        return DEFAULT_PORT
    # Every rank of a job derives the same port; two jobs on one node rarely collide.
    return DEFAULT_PORT + int(hashlib.sha256(job_id.encode()).hexdigest(), 16) % PORT_SPREAD


def check_host(host: str, where: str) -> None:
    """Refuse ``host`` unless the whole of it is a host name (no trailing newline either)."""
    if not HOSTNAME.fullmatch(host):
        shown = host if len(host) <= 80 else host[:77] + "..."
        raise GoodputError(
            where,
            f"{shown!r} is not a valid host name",
            "fix the host list; names are letters, digits, '.', '-', '_'",
        )


def current_placement() -> Placement:
    """``read_placement`` of this process's environment; under PBS, its host file read."""
    nodefile = os.environ.get("PBS_NODEFILE")
    in_pbs_job = "PBS_JOBID" in os.environ and "SLURM_JOB_ID" not in os.environ
    hostfile_text = read_text(nodefile, MAX_HOSTFILE_BYTES) if nodefile and in_pbs_job else None
    return read_placement(os.environ, hostfile_text)
