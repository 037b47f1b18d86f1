"""The Python API behind ``goodput launch``: ``run(LaunchOptions(command=[...], ...))``.

It reads where it runs (``env.current_placement``), plans the ranks (``launchers``), makes the
run folder, then runs attempts through the one attempt loop (``retry``) with plain retries or
``--auto-retry``'s policy, and returns the exit code ``goodput launch`` exits with.
``goodput launch`` is a thin parse of its options into a call of ``run``, and every job of a
``goodput submit`` chain runs such a line; any other caller (a chaos campaign) comes through here
too, so that a launch behaves the same whoever started it. Every attempt is logged to
``RUN_DIR/attempts.jsonl`` (``history``). Every rank is told where the launcher reads the
heartbeat (``ranks.HEARTBEAT_VAR``: ``RUN_DIR/heartbeat``), and ``goodput train`` keeps one
there too: progress is seen whatever ``train.run_dir`` is and wherever the step lines go. Like
all of ``goodput.launch``, it never imports torch (but for ``--in-process``'s recovery
store, ``inprocess``, imported only when that option is given).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from goodput import rundir
from goodput.errors import ExitCode
from goodput.launch import beacon_folder, failover, inprocess, launchers
from goodput.launch.attempt import Attempt, AttemptResult, open_attempt
from goodput.launch.env import current_placement
from goodput.launch.history import Evidence
from goodput.launch.retry import Policy, run_attempts
from goodput.ranks import BEACON_DIR_VAR, EVICT_VAR, HEARTBEAT_VAR

PROFILE_VAR = "GOODPUT_PROFILE"  # the profile when none is named
DEFAULT_IDLE_TIMEOUT_S = 1800.0  # --auto-retry's: long enough for a checkpoint or an eval
MAX_STEPLESS_ATTEMPTS = 2  # --auto-retry stops after this many attempts in a row without a step
FORENSICS_MARGIN_S = 10.0  # the forensics' bound past the hosts' own: start-up, parsing


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchOptions:
    """What ``goodput launch`` takes, as its options name it (``goodput launch --help``)."""

    command: tuple[str, ...]  # what every rank runs
    nhosts: int | None = None  # the first N hosts of the job run ranks; the rest are spares
    ppn: int | None = None  # ranks per host; None: the profile's
    nproc: int | None = None  # ranks in all; None: nhosts x ppn
    profile: str | None = None  # a name or a .toml path; None: $GOODPUT_PROFILE, else generic
    idle_timeout_s: float | None = None  # None: never, 1800 with auto_retry; 0: never
    startup_timeout_s: float | None = None  # before the first step line; None: idle_timeout_s
    retries: int | None = None  # None: 0, no limit but the policy's with auto_retry
    backoff_s: float = 5.0
    auto_retry: bool = False
    evict_stragglers: bool = False  # with auto_retry: a straggler's host is replaced by a spare
    grace_s: float = 10.0  # between SIGTERM and SIGKILL
    log: Path | None = None  # all output is appended here too
    run_dir: Path | None = None  # None: the log's folder, else ./launch-JOBID
    prefix: bool = True  # [rank] before each output line
    in_process: bool = False  # a rank's death is recovered in process (``launch.inprocess``)
    spares_warm: int = 0  # with in_process: warm spare processes kept started
    recovery_timeout_s: float = inprocess.DEFAULT_TIMEOUT_S  # with in_process: a leave or join


def load_profile(options: LaunchOptions) -> launchers.ProfileConfig:
    """The machine profile ``options`` names, else ``$GOODPUT_PROFILE``, else generic."""
    return launchers.load_profile(
        options.profile or os.environ.get(PROFILE_VAR) or launchers.DEFAULT_PROFILE
    )


def named_run_dir(options: LaunchOptions) -> Path | None:
    """The run folder the options name: ``--run-dir``, else the ``--log``'s folder."""
    return options.run_dir or (options.log.parent if options.log else None)


def default_run_dir(job_id: str | None) -> Path:
    """The run folder when the options name none: ``launch-JOBID`` in the working folder."""
    return Path(f"launch-{job_id or 'local'}")


def run(options: LaunchOptions, *, dry_run: bool = False) -> ExitCode:
    """Launch ``options.command``; the exit code of ``goodput launch``: the last attempt's when
    ``ExitCode`` names it, else 1 (a death by signal: ``attempts.jsonl`` keeps the number).
    ``dry_run`` prints the command line(s) and writes nothing."""
    profile = load_profile(options)
    placement = current_placement()
    # Absolute: the printed command works from any directory.
    run_dir = (named_run_dir(options) or default_run_dir(placement.job_id)).absolute()
    plan = launchers.plan_launch(
        placement,
        profile,
        run_dir=run_dir,
        nhosts=options.nhosts,
        ppn=options.ppn,
        nproc=options.nproc,
    )
    processes = launchers.build_processes(plan, options.command, os.environ)
    print(f"launch: {launchers.describe_plan(plan)}", file=sys.stderr)
    if options.in_process and plan.scheduler != "local":
        print(
            f"launch: --in-process needs the local launcher in this version (this is "
            f"{plan.scheduler}): a rank's death restarts every rank",
            file=sys.stderr,
        )
        options = dataclasses.replace(options, in_process=False)
    if dry_run:
        for line in launchers.format_processes(processes, os.environ):
            print(line)
        return ExitCode.OK
    launchers.prepare_outputs(run_dir, options.log)
    heartbeat = run_dir / rundir.HEARTBEAT
    beacons = beacon_folder.launch_folder(placement.job_id)
    starter = _AttemptStarter(plan, options, {**os.environ, HEARTBEAT_VAR: str(heartbeat)}, beacons)
    try:
        code = run_attempts(
            starter,
            _policy(plan, options),
            failover.Pool(list(plan.hosts), list(plan.spares)),
            attempts_log=run_dir / rundir.ATTEMPTS,
            heartbeat=heartbeat,
            job=placement.job_id,
        )
    finally:
        starter.close()
        beacon_folder.remove_folder(beacons)
    return ExitCode(code) if code in {member.value for member in ExitCode} else ExitCode.ERROR


def _policy(plan: launchers.LaunchPlan, options: LaunchOptions) -> Policy:
    max_attempts = None if options.retries is None else options.retries + 1
    if not options.auto_retry:
        return Policy(max_attempts=max_attempts or 1, backoff_s=options.backoff_s)

    def probe(hosts: tuple[str, ...]) -> dict[str, Evidence]:
        return failover.probe_hosts(plan, hosts, os.environ)

    return Policy(
        max_attempts=max_attempts,
        backoff_s=options.backoff_s,
        patterns=(*failover.BAD_NODE_PATTERNS, *plan.profile.bad_node_patterns),
        peer_patterns=failover.PEER_PATTERNS,
        probe=probe,
        max_stepless=MAX_STEPLESS_ATTEMPTS,
    )


class _AttemptStarter:
    """``run_attempts``'s ``StartAttempt``: each call starts the processes afresh, or, after an
    attempt that ended with ``continues`` (a rank died under ``--in-process``), runs the same
    processes on through their in-process recovery. ``close`` stops any still running."""

    def __init__(
        self, plan: launchers.LaunchPlan, options: LaunchOptions, env: dict[str, str], beacons: Path
    ):
        # ``env``: what the ranks get (through srun or mpiexec, which pass it on); ``beacons``:
        # the launch's beacon folder, with a folder per attempt in it.
        self.plan, self.options, self.env, self.beacons = plan, options, env, beacons
        timeout_s = options.idle_timeout_s
        if timeout_s is None and options.auto_retry:
            timeout_s = DEFAULT_IDLE_TIMEOUT_S
        self.timeout_s = timeout_s
        self.numbers = itertools.count(1)
        # Hosts that ran an attempt: a spare, once used, is never a spare again (failover.Pool).
        self.used: set[str] = set()
        self.live: Attempt | None = None  # processes an in-process recovery carries on
        self.folder: Path | None = None

    def __call__(
        self, hosts: tuple[str, ...], on_line: Callable[[bytes], None] | None
    ) -> AttemptResult:
        if self.live is None:
            self.live = self._open(hosts, on_line)
        result = self.live.run()
        if not result.continues:
            self._forget()
        return result

    def close(self) -> None:
        """Stop what a stopped loop left running (an attempt that continued into no next one)."""
        if self.live is not None:
            self.live.death = None
            self.live.stop(self.options.grace_s, [])
            self._forget()

    def _forget(self) -> None:
        self.live = None
        if self.folder is not None:
            beacon_folder.remove_folder(self.folder)
            self.folder = None

    def _open(self, hosts: tuple[str, ...], on_line: Callable[[bytes], None] | None) -> Attempt:
        plan, options = self.plan, self.options
        # Imported here, not with the package: ``python -m goodput.launch.forensics`` (run on each
        # host) would otherwise find its module imported already by ``goodput.launch``.
        from goodput.launch import forensics, suspects

        bound_s = forensics.DUMP_WAIT_S + FORENSICS_MARGIN_S
        if plan.scheduler != "local":
            bound_s += plan.profile.health_timeout_s
        # Built afresh each attempt: a local rendezvous port is free only for a moment, and
        # --auto-retry may have replaced hosts.
        spares = tuple(host for host in plan.hosts + plan.spares if host not in hosts)
        attempt_plan = dataclasses.replace(plan, hosts=hosts, spares=spares)
        launchers.write_hostfile(attempt_plan)
        folder = self.folder = beacon_folder.attempt_folder(self.beacons, next(self.numbers))
        rank_env = {**self.env, BEACON_DIR_VAR: str(folder)}
        rank_env.pop(EVICT_VAR, None)  # the launcher's to give, never inherited
        self.used.update(hosts)
        if options.evict_stragglers and not self.used.issuperset(plan.spares):
            rank_env[EVICT_VAR] = "1"
        in_process = None
        if options.in_process:  # a new store each fresh start: its keys are one start's
            in_process = inprocess.InProcess(options.spares_warm, options.recovery_timeout_s)
            rank_env |= in_process.rank_env()
        try:
            return open_attempt(
                launchers.build_processes(attempt_plan, options.command, rank_env),
                idle_timeout_s=self.timeout_s or None,  # 0: no watchdog
                startup_timeout_s=options.startup_timeout_s,
                grace_s=options.grace_s,
                log_path=options.log,
                prefix=options.prefix,
                on_line=on_line,
                on_idle_timeout=lambda notice: suspects.investigate(
                    attempt_plan, folder, rank_env, notice
                ),
                on_idle_timeout_bound_s=bound_s,
                in_process=in_process,
            )
        except BaseException:
            self._forget()
            raise
