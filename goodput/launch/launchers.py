"""Launch plans and the command lines that carry them out: srun, mpiexec, or local processes.

A ``LaunchPlan`` says which hosts of the allocation run ranks (the first ``nhosts``; the rest are
spares for later attempts), how many ranks per host and in all, and which machine profile
applies. ``build_processes`` turns a plan and a command into ``ProcessSpec``s for
``attempt.run_attempt``, through a builder keyed by scheduler (``BUILDERS``):
  - slurm: one ``srun`` reading the exact host set from the attempt's host file
    (``--nodelist``), its task counts and ``--kill-on-bad-exit=1``;
  - pbs: one ``mpiexec`` reading the same host file (the active hosts only), in the flag dialect
    of the profile (MPICH Hydra or Cray PALS);
  - local: one process per rank on this machine, with torchrun's variables and a free port.
Every rank gets the host file's path (``ranks.HOSTFILE_VAR``), never the names: at 10,624 hosts
they are past what one argument or variable may hold (128 KiB), and exec fails (E2BIG).
Invariants: argv lists, never shell strings; every host name is validated before it reaches a
command line; a different host set always gives a different command (the host file is named
by its contents, so an attempt's file never changes under it). Machine specifics (ranks per
node, CPU binding, environment) are data: ``profiles/NAME.toml``, parsed strictly (unknown keys,
wrong types, values out of range and patterns that do not compile are one line naming the
file). Rank counts are bounded (``MAX_PPN`` a host), so no plan builds an absurd list.
``prepare_outputs`` makes the run folder and the log before any rank starts, so a path that
cannot take them is one line naming its option. Standard library only, and nothing here starts
a process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shlex
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from goodput import rundir
from goodput.config import from_table, limits, read_toml
from goodput.errors import GoodputError, from_exception
from goodput.io import write_text
from goodput.launch import device_tools
from goodput.launch.attempt import ProcessSpec
from goodput.launch.env import Placement, check_host
from goodput.outputs import LAUNCH_DIR, LAUNCH_LOG, check_output_dir, check_output_file
from goodput.ranks import HOSTFILE_VAR, LOCAL_WORLD_SIZE_VAR, PROBE_HOST_VAR

PROFILE_DIR = Path(__file__).with_name("profiles")
DEFAULT_PROFILE = "generic"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # always fullmatch: no "\n" after
CPU_BIND = re.compile(r"[A-Za-z0-9_:,.=+-]{1,1000}")  # "cores", "depth", "list:1-8:9-16"
# Ranks on one host: past any node (a 512-thread CPU node at one rank each) by a margin; it keeps
# a local launch from planning a process per rank of a typo.
MAX_PPN = 1024
MAX_HEALTH_TIMEOUT_S = 86400.0
LOCAL_ADDR = "127.0.0.1"
# An overlapping srun step's memory: Python and goodput's launch modules (23 MB resident, measured)
# with room; a step asking for none would ask for the node's, which the hung step holds.
OVERLAP_MEM = "256M"
# The default probe, by module name: imported here, ``python -m`` would find it imported already.
HEALTH_MODULE = "goodput.launch.health"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileConfig:
    """One machine: how many ranks a node takes and how they are bound and configured."""

    name: str  # the file's stem; not written in the file
    description: str = ""
    # Ranks per node when --ppn and --nproc are not given.
    ppn: int = field(default=1, metadata=limits(at_least=1, at_most=MAX_PPN))
    mpiexec: Literal["hydra", "pals"] = "hydra"  # the flag dialect of the PBS launcher
    # What a job chain (goodput submit) asks for on each node: every CPU of it (Slurm
    # --exclusive, PBS place=...:excl), as GPU nodes need, or one CPU per rank.
    whole_nodes: bool = False
    cpu_bind: str | None = None  # srun --cpu-bind=, PALS --cpu-bind, Hydra -bind-to
    env: tuple[str, ...] = ()  # NAME=VALUE set for every rank
    pass_env: tuple[str, ...] = ()  # names mpiexec forwards explicitly from the launcher's env
    srun_args: tuple[str, ...] = ()
    mpiexec_args: tuple[str, ...] = ()
    # --auto-retry: log lines that name a bad host, as regular expressions with a group
    # ``host`` (a host name) or ``addr`` (an address to resolve); added to failover's own.
    bad_node_patterns: tuple[str, ...] = ()
    # The per-host probe run before evicting a host no log line named (argv; exit 0 = healthy).
    health_check: tuple[str, ...] = (sys.executable, "-m", HEALTH_MODULE)
    # The default probe with --device, in the launcher's own interpreter (a "python" on the
    # job's PATH may not be the one goodput is installed in): ``health_command``.
    health_device: bool = False
    health_vendor: Literal["auto", "nvidia", "amd", "intel"] = "auto"  # device_tools.VENDORS
    health_expect_devices: int | None = field(
        default=None, metadata=limits(at_least=1, at_most=device_tools.MAX_DEVICES)
    )
    health_timeout_s: float = field(
        default=60.0, metadata=limits(above=0, at_most=MAX_HEALTH_TIMEOUT_S)
    )

    def __post_init__(self) -> None:
        if self.cpu_bind is not None and not CPU_BIND.fullmatch(self.cpu_bind):
            raise GoodputError.usage(
                "[profile]",
                f"cpu_bind {self.cpu_bind!r} is not a binding",
                'use letters, digits and _:,.=+-, e.g. "cores" or "list:1-8:9-16"',
            )
        for item in self.env:
            name, sep, _ = item.partition("=")
            if not sep or not ENV_NAME.fullmatch(name):
                raise GoodputError.usage(
                    "[profile]",
                    f"env entry {item!r} is not NAME=VALUE",
                    'write entries like "FI_CXI_DEFAULT_CQ_SIZE=131072"',
                )
        for name in self.pass_env:
            if not ENV_NAME.fullmatch(name):
                raise GoodputError.usage(
                    "[profile]",
                    f"pass_env entry {name!r} is not a variable name",
                    "list names only, without values",
                )

        for pattern in self.bad_node_patterns:
            try:
                groups = re.compile(pattern).groupindex
            # OverflowError: a repeat count past the engine's; RecursionError: deep nesting.
            except (re.error, OverflowError, RecursionError) as error:
                raise GoodputError.usage(
                    "[profile]",
                    f"bad_node_patterns entry {pattern!r} is not a regular expression: {error}",
                    "fix the pattern (TOML literal strings '...' keep backslashes as written)",
                ) from None
            if "host" not in groups and "addr" not in groups:
                raise GoodputError.usage(
                    "[profile]",
                    f"bad_node_patterns entry {pattern!r} names no host",
                    "capture the host as (?P<host>...) or its address as (?P<addr>...)",
                )
        if not self.health_check:
            raise GoodputError.usage(
                "[profile]",
                "health_check is empty",
                'give a command, e.g. ["true"]',
            )

    def env_vars(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.env)

    def inert_keys(self) -> dict[str, str]:
        """The device keys do nothing without ``health_device``, and ``health_check`` nothing
        with it (``config.from_table`` refuses them when set)."""
        if self.health_device:
            return {"health_check": "health_device = false"}
        return dict.fromkeys(("health_vendor", "health_expect_devices"), "health_device = true")

    def health_command(self) -> list[str]:
        """The probe's argv: ``health_check``, or with ``health_device`` the default probe
        with ``--device --vendor V [--expect-devices N]``."""
        if not self.health_device:
            return list(self.health_check)
        argv = [sys.executable, "-m", HEALTH_MODULE, "--device", "--vendor", self.health_vendor]
        if self.health_expect_devices is not None:
            argv += ["--expect-devices", str(self.health_expect_devices)]
        return argv


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    scheduler: str  # "slurm" | "pbs" | "local"
    hosts: tuple[str, ...]  # the hosts that run ranks, in allocation order
    spares: tuple[str, ...]  # allocated but unused this attempt
    ppn: int
    nproc: int
    profile: ProfileConfig
    master_port: int  # the job's rendezvous port (local ranks pick a free one per attempt)
    run_dir: Path  # where the launcher writes its files (the host file)

    @property
    def hostfile(self) -> Path:
        """The host file of exactly these hosts (``hostfile_path``)."""
        return hostfile_path(self.run_dir, self.hosts)


def hostfile_path(run_dir: Path, hosts: Sequence[str]) -> Path:
    """The host file of exactly ``hosts`` in ``run_dir``, named by its contents; absolute, as the
    ranks read it wherever they run, and as srun's ``--nodelist`` takes a value with a '/' for a
    file."""
    digest = hashlib.sha256("\n".join(hosts).encode()).hexdigest()[:12]
    return run_dir.absolute() / f"{rundir.HOSTFILE_PREFIX}{digest}"


def write_hosts(run_dir: Path, hosts: Sequence[str]) -> Path:
    """Write the host file of ``hosts`` in ``run_dir`` (``hostfile_path``), one a line, as srun,
    mpiexec and ``ranks.launch_hosts`` read it; atomically: a launcher or a rank never reads half
    of one."""
    path = hostfile_path(run_dir, hosts)
    write_text(path, "".join(f"{host}\n" for host in hosts))
    return path


def profile_names() -> list[str]:
    return sorted(path.stem for path in PROFILE_DIR.glob("*.toml"))


def load_profile(name: str) -> ProfileConfig:
    """A shipped profile by name (``aurora``), or any profile file by path (``./mine.toml``)."""
    if name.endswith(".toml") or os.sep in name:
        path = Path(name)
    elif name in profile_names():
        path = PROFILE_DIR / f"{name}.toml"
    else:
        raise GoodputError.usage(
            "--profile",
            f"unknown machine profile {name!r}",
            f"use one of {', '.join(profile_names())}, or the path of a profile .toml file",
        )
    raw = read_toml(path)
    if "name" in raw:
        raise GoodputError.usage(
            path,
            "a profile has no 'name' key",
            "remove it; the name is the file's",
        )
    return from_table(ProfileConfig, {**raw, "name": path.stem}, str(path))


def plan_launch(
    placement: Placement,
    profile: ProfileConfig,
    *,
    run_dir: Path,
    nhosts: int | None = None,
    ppn: int | None = None,
    nproc: int | None = None,
) -> LaunchPlan:
    """Choose hosts and counts. Defaults: every allocated host; the profile's ranks per node
    (or ``nproc`` spread over the hosts); ``nproc = nhosts * ppn``. Every host runs a rank."""
    available = placement.hosts
    num_hosts = len(available) if nhosts is None else nhosts
    if not 1 <= num_hosts <= len(available):
        where = f"in the {placement.scheduler} allocation"
        if placement.scheduler == "local":
            where = "on this machine (outside a Slurm or PBS job)"
        raise GoodputError.usage(
            "--nhosts",
            f"{num_hosts} hosts asked for, {len(available)} {where}",
            f"ask for 1 to {len(available)}",
        )
    ppn, nproc = rank_counts(profile, num_hosts, ppn=ppn, nproc=nproc)
    for host in available:  # spares too: any of them may run ranks later
        check_host(host, "launch host list")
    hosts = available[:num_hosts]
    return LaunchPlan(
        placement.scheduler,
        hosts,
        available[num_hosts:],
        ppn,
        nproc,
        profile,
        placement.master_port,
        run_dir,
    )


def rank_counts(
    profile: ProfileConfig, num_hosts: int, *, ppn: int | None, nproc: int | None
) -> tuple[int, int]:
    """Ranks per host and in all on ``num_hosts`` hosts, as ``plan_launch`` defaults them; a job
    chain sizes its allocation by the same rule."""
    for count, flag in ((ppn, "--ppn"), (nproc, "--nproc")):
        if count is not None and count < 1:
            raise GoodputError.usage(flag, f"{count} is not a count", "use 1 or more")
    if ppn is None:
        ppn = profile.ppn if nproc is None else -(-nproc // num_hosts)
    if ppn > MAX_PPN:
        raise GoodputError.usage(
            "--ppn" if nproc is None else "--nproc",
            f"{ppn} ranks a host is more than {MAX_PPN}",
            "ask for fewer ranks, or more hosts",
        )
    if nproc is None:
        nproc = num_hosts * ppn
    if not (num_hosts - 1) * ppn < nproc <= num_hosts * ppn:
        raise GoodputError.usage(
            "--nproc",
            f"{nproc} ranks do not fit {num_hosts} hosts x {ppn} per host with a rank on each",
            f"use --nproc from {(num_hosts - 1) * ppn + 1} to {num_hosts * ppn}, "
            "or change --nhosts/--ppn",
        )
    return ppn, nproc


def build_processes(
    plan: LaunchPlan, command: Sequence[str], env: Mapping[str, str]
) -> list[ProcessSpec]:
    """The processes that run ``command`` as planned; ``env`` is the launcher's environment."""
    if not command:
        raise GoodputError.usage(
            "goodput launch",
            "no command to run",
            "put it after --, e.g. goodput launch -- goodput train CONFIG.toml",
        )
    return BUILDERS[plan.scheduler](plan, list(command), dict(env))


def _srun(plan: LaunchPlan, command: list[str], env: dict[str, str]) -> list[ProcessSpec]:
    """srun propagates the launcher's whole environment (``--export=ALL``), so the profile's
    variables travel in the environment of srun itself."""
    cpu_bind = [f"--cpu-bind={plan.profile.cpu_bind}"] if plan.profile.cpu_bind else []
    argv = [
        "srun",
        "--nodes",
        str(len(plan.hosts)),
        "--ntasks",
        str(plan.nproc),
        "--ntasks-per-node",
        str(plan.ppn),
        "--nodelist",
        str(plan.hostfile),  # a file: the names of 10,624 hosts are past one argument's limit
        # One failed task ends the step at once instead of leaving the others in a collective.
        "--kill-on-bad-exit=1",
        *cpu_bind,
        *plan.profile.srun_args,
        *command,
    ]
    return [ProcessSpec(argv, {**env, **_rank_env(plan)}, "srun")]


def _mpiexec(plan: LaunchPlan, command: list[str], env: dict[str, str]) -> list[ProcessSpec]:
    """Both dialects forward the launcher's environment by default; the profile's variables are
    named on the command line as well, so the command shows everything the ranks get."""
    hydra = plan.profile.mpiexec == "hydra"
    argv = ["mpiexec", *(["-n"] if hydra else ["--np"]), str(plan.nproc)]
    argv += [*(["-ppn"] if hydra else ["--ppn"]), str(plan.ppn)]
    argv += [*(["-hostfile"] if hydra else ["--hostfile"]), str(plan.hostfile)]
    if plan.profile.cpu_bind:
        argv += ["-bind-to" if hydra else "--cpu-bind", plan.profile.cpu_bind]
    forwarded = [name for name in plan.profile.pass_env if name in env]
    if forwarded:
        argv += ["-genvlist" if hydra else "--envlist", ",".join(forwarded)]
    for name, value in _rank_env(plan).items():
        argv += ["-genv", name, value] if hydra else ["--env", f"{name}={value}"]
    argv += [*plan.profile.mpiexec_args, *command]
    return [ProcessSpec(argv, env, "mpiexec")]


def _local(plan: LaunchPlan, command: list[str], env: dict[str, str]) -> list[ProcessSpec]:
    """One process per rank, with the variables torchrun sets; a rendezvous port free now."""
    if plan.hosts != ("localhost",):
        raise GoodputError.usage(
            "local launch",
            f"cannot start ranks on {', '.join(plan.hosts)}",
            "run inside a Slurm or PBS job to use other hosts",
        )
    port = str(free_port())
    # As torchrun does: ranks sharing this machine share its cores, so each gets its slice of
    # threads rather than all of them (2 ranks x all cores thrash); an explicit setting wins.
    threads = env.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // plan.nproc))
    specs = []
    for rank in range(plan.nproc):
        rank_env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(plan.nproc),
            "LOCAL_WORLD_SIZE": str(plan.nproc),
            "MASTER_ADDR": LOCAL_ADDR,
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": threads,
            HOSTFILE_VAR: str(plan.hostfile),
        }
        merged = {**env, **plan.profile.env_vars(), **rank_env}
        specs.append(ProcessSpec(command, merged, f"rank{rank}"))
    return specs


def _rank_env(plan: LaunchPlan) -> dict[str, str]:
    # Named outright: ranks read the whole allocation's host list, whose first host need not
    # run rank 0 once spares replace hosts. Slurm places rank 0 on the first host in its own
    # (sorted) order; the plan keeps that order because it takes a prefix of the allocation.
    # LOCAL_WORLD_SIZE: the ranks a host, which neither srun nor mpiexec sets under that name,
    # for ranks.rank_host's rule (a torchrun under the launcher sets its own).
    return {
        **plan.profile.env_vars(),
        "MASTER_ADDR": plan.hosts[0],
        "MASTER_PORT": str(plan.master_port),
        HOSTFILE_VAR: str(plan.hostfile),
        LOCAL_WORLD_SIZE_VAR: str(plan.ppn),
    }


def build_host_command(
    plan: LaunchPlan,
    hosts: tuple[str, ...],
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    overlap: bool = False,
) -> ProcessSpec:
    """``argv`` run once on each of ``hosts``, one task a host, as one step of the job's own
    launcher (a local plan runs it here, for its one host). One host is named on the command
    line and told its name in ``PROBE_HOST_VAR``; several by their host file, which the caller
    writes first (``write_hostfile(plan, hosts)``): thousands of names are past what one
    argument may hold. ``overlap``: while the attempt's own step still holds the nodes (hang
    forensics): under Slurm ``srun --overlap`` with a small memory request and without the
    profile's srun extras (they ask for GPUs and CPUs the hung step holds); verified under the
    single-node Slurm of CI, where a plain ``srun`` waits for the step."""
    for host in hosts:
        check_host(host, "host command")
    one = hosts[0] if len(hosts) == 1 else None
    host_env = {**env, **plan.profile.env_vars()}
    if one is not None:
        host_env[PROBE_HOST_VAR] = one
    named = one or str(dataclasses.replace(plan, hosts=hosts).hostfile)
    count = str(len(hosts))
    if plan.scheduler == "slurm":
        tasks = ["--nodes", count, "--ntasks", count]
        tasks += ["--nodelist", named] if one else ["--ntasks-per-node", "1", "--nodelist", named]
        if overlap:
            command = ["srun", "--overlap", *tasks, "--mem", OVERLAP_MEM, *argv]
        else:
            command = ["srun", *tasks, *plan.profile.srun_args, *argv]
    elif plan.scheduler == "pbs":
        hydra = plan.profile.mpiexec == "hydra"
        command = ["mpiexec", "-n" if hydra else "--np", count]
        if one is not None:
            command += ["-hosts" if hydra else "--hosts", one]
            if hydra:
                command += ["-genv", PROBE_HOST_VAR, one]
            else:
                command += ["--env", f"{PROBE_HOST_VAR}={one}"]
        else:
            command += ["-ppn" if hydra else "--ppn", "1"]
            command += ["-hostfile" if hydra else "--hostfile", named]
        command += [*plan.profile.mpiexec_args, *argv]
    else:
        command = list(argv)
    return ProcessSpec(command, host_env, one or f"{count} hosts")


BUILDERS: dict[str, Callable[[LaunchPlan, list[str], dict[str, str]], list[ProcessSpec]]] = {
    "slurm": _srun,
    "pbs": _mpiexec,
    "local": _local,
}


def describe_plan(plan: LaunchPlan) -> str:
    """One line: where, how many, which profile."""
    spares = f", {len(plan.spares)} spare ({','.join(plan.spares)})" if plan.spares else ""
    return (
        f"{plan.scheduler}: {len(plan.hosts)} host(s) x {plan.ppn} = {plan.nproc} rank(s) on "
        f"{','.join(plan.hosts)}{spares}; profile {plan.profile.name}, host file {plan.hostfile}"
    )


def write_hostfile(plan: LaunchPlan, hosts: tuple[str, ...] | None = None) -> Path:
    """Write the host file of the plan's hosts (the attempt's: srun, mpiexec and every rank read
    it), or of ``hosts`` for a step over them (``build_host_command``): ``write_hosts``."""
    return write_hosts(plan.run_dir, plan.hosts if hosts is None else hosts)


def prepare_outputs(run_dir: Path, log: Path | None) -> None:
    """Open ``log`` for appending and make ``run_dir`` now, before any rank starts, so that a
    path that cannot take them (a file where the folder goes, a folder as the log, no
    permission) is one line naming its option rather than a failure in the first attempt. The
    log may not be a file of a run (but a log beside its files) nor a file that is no log; the
    run folder may be a run directory, not a folder inside one or inside a checkpoint."""
    if log is not None:
        check_output_file(log, LAUNCH_LOG, "--log")
    check_output_dir(run_dir, LAUNCH_DIR, "--run-dir")
    if log is not None:
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab"):
                pass
        except OSError as exc:
            raise _option_error("--log", exc) from None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _option_error("--run-dir", exc) from None


def _option_error(option: str, exc: OSError) -> GoodputError:
    error = from_exception(exc)
    return GoodputError.usage(f"{option} {error.where}", error.what, error.fix)


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's choice); rank 0 binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOCAL_ADDR, 0))
        return int(sock.getsockname()[1])


def format_processes(specs: Sequence[ProcessSpec], base_env: Mapping[str, str]) -> list[str]:
    """One shell line per process: the variables it gets beyond ``base_env``, then its argv."""
    lines = []
    for spec in specs:
        added = [f"{k}={shlex.quote(v)}" for k, v in spec.env.items() if base_env.get(k) != v]
        lines.append(" ".join([*added, shlex.join(spec.argv)]))
    return lines
