"""``goodput launch``: its options parsed into ``goodput.launch.LaunchOptions`` and one call of
``goodput.launch.run``, which does all the work. ``goodput submit`` parses the launch line of
its jobs here too, so that the two never disagree about what the line means."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from goodput import argtypes
from goodput.commands import OneLineErrorParser, Subparsers, after_dashes
from goodput.errors import ExitCode, GoodputError

if TYPE_CHECKING:
    from goodput.launch import LaunchOptions


MAX_SPARES_WARM = 1024  # warm spare processes a launch keeps: far past any host's cores


def register(groups: Subparsers) -> None:
    launch = groups.add_parser(
        "launch",
        help="run a command on the job's hosts (srun, mpiexec or local ranks), watch it, retry it",
        description="Run CMD as NPROC ranks: with srun inside a Slurm job, with mpiexec inside a "
        "PBS job, else as local processes with torchrun's variables. Stops every rank when one "
        "fails or all go quiet for --timeout seconds; retries up to --retries times.",
        usage="goodput launch [options] -- CMD ...",
    )
    launch.add_argument(
        "--nhosts",
        type=argtypes.positive_int,
        help="use the first N hosts of the job; the rest are spares",
    )
    launch.add_argument(
        "--ppn", type=argtypes.positive_int, help="ranks per host (default: the profile's)"
    )
    launch.add_argument(
        "--nproc", type=argtypes.positive_int, help="ranks in all (default: nhosts x ppn)"
    )
    launch.add_argument(
        "--profile",
        help="machine profile: generic, aurora, polaris, perlmutter, frontier, or a .toml path "
        "(default: $GOODPUT_PROFILE, else generic)",
    )
    launch.add_argument("--dry-run", action="store_true", help="print the command line(s) and exit")
    launch.add_argument(
        "--timeout",
        type=argtypes.non_negative_float,
        metavar="S",
        help="stop all ranks after S seconds without output (exit 124; default: never, 1800 "
        "with --auto-retry; 0: never)",
    )
    launch.add_argument(
        "--startup-timeout",
        type=argtypes.positive_float,
        metavar="S",
        help="the --timeout until an attempt's first step=N line: start-up (imports, the "
        "rendezvous, a checkpoint load) may be quiet longer than a step (default: --timeout)",
    )
    launch.add_argument(
        "--retries",
        type=argtypes.non_negative_int,
        help="attempts after a failed one (default 0; with --auto-retry: no limit but its own)",
    )
    launch.add_argument(
        "--backoff",
        type=argtypes.non_negative_float,
        default=5.0,
        metavar="S",
        help="seconds before a retry after an attempt that reached no new step, doubling while "
        "none does, up to 300, jittered (default 5); after progress the wait is at most 1 s",
    )
    launch.add_argument(
        "--auto-retry",
        action="store_true",
        help="classify each failed attempt, replace bad hosts from the spares (--nhosts N of "
        "a larger job): a host is bad on host evidence (a device error, a node failure) or a "
        "failed health probe; a peer that went away only gets its host probed. Stop after 2 "
        "attempts without a step, at walltime, on Ctrl-C or when a bad host has no spare "
        "(--timeout defaults to 1800)",
    )
    launch.add_argument(
        "--evict-stragglers",
        action="store_true",
        help="with --auto-retry, while a spare is left: a rank warned about as a straggler "
        "makes the trainer stop after its next periodic save (exit 4); its host is replaced by "
        "a spare and the run resumes",
    )
    launch.add_argument(
        "--in-process",
        action="store_true",
        help="local launcher: when a rank dies, the others keep their process and roll back in "
        "place to the newest in-memory checkpoint (checkpoint.memory_interval_steps) while a "
        "warm spare takes the dead rank's place; without a spare, or when the recovery fails, "
        "every rank restarts as --retries or --auto-retry say (needs torch where it runs)",
    )
    launch.add_argument(
        "--spares-warm",
        type=argtypes.integer(0, MAX_SPARES_WARM),
        default=0,
        metavar="N",
        help="with --in-process: keep N spare processes started, imports done, each ready to "
        "take a dead rank's place (default 0)",
    )
    launch.add_argument(
        "--recovery-timeout",
        type=argtypes.positive_float,
        default=60.0,  # launch.inprocess.DEFAULT_TIMEOUT_S, not imported: CLI start-up stays light
        metavar="S",
        help="with --in-process: the longest wait for the ranks to leave their step or join "
        "the new process groups before every rank restarts instead (default 60)",
    )
    launch.add_argument(
        "--grace",
        type=argtypes.non_negative_float,
        default=10.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 10)",
    )
    launch.add_argument("--log", type=Path, help="also append all output to this file")
    launch.add_argument(
        "--run-dir",
        type=Path,
        help="where attempts.jsonl and the host files go (default: the --log file's "
        "folder, else ./launch-JOBID)",
    )
    launch.add_argument(
        "--no-prefix", action="store_true", help="do not prefix output lines with [rank]"
    )
    launch.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    launch.set_defaults(handler=_launch)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """``goodput launch ARGV`` parsed as the command parses it (argparse's own errors: one
    line, exit 2), and the arguments it does not know."""
    parser = OneLineErrorParser(prog="goodput")
    register(parser.add_subparsers())
    return parser.parse_known_args(["launch", *argv])


def options(args: argparse.Namespace) -> LaunchOptions:
    """The parsed options of ``goodput launch``, as the Python API takes them."""
    from goodput.launch import LaunchOptions

    if args.evict_stragglers and not args.auto_retry:
        raise GoodputError.usage(
            "--evict-stragglers",
            "replaces hosts, which only --auto-retry does",
            "add --auto-retry (and spare hosts: --nhosts N of a larger job)",
        )
    if args.spares_warm and not args.in_process:
        raise GoodputError.usage(
            "--spares-warm", "keeps spares for in-process recovery", "add --in-process"
        )
    return LaunchOptions(
        command=tuple(after_dashes(args.cmd)),
        nhosts=args.nhosts,
        ppn=args.ppn,
        nproc=args.nproc,
        profile=args.profile,
        idle_timeout_s=args.timeout,
        startup_timeout_s=args.startup_timeout,
        retries=args.retries,
        backoff_s=args.backoff,
        auto_retry=args.auto_retry,
        evict_stragglers=args.evict_stragglers,
        grace_s=args.grace,
        log=args.log,
        run_dir=args.run_dir,
        prefix=not args.no_prefix,
        in_process=args.in_process,
        spares_warm=args.spares_warm,
        recovery_timeout_s=args.recovery_timeout,
    )


def _launch(args: argparse.Namespace) -> ExitCode:
    from goodput.launch import run

    return run(options(args), dry_run=args.dry_run)
