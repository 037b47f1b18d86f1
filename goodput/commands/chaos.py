"""``goodput chaos``: its options parsed into ``goodput.chaos.campaign.CampaignOptions``, one call
of ``run_campaign``, and the report printed. Exit 0 only when the faulted run finished, every
fault fired, every slow and stall fault's rank and host were named by the launcher, with memory
snapshots on (``checkpoint.memory_interval_steps`` k > 0) every fault that ended an attempt lost
at most k steps and every host-loss restart loaded its partner's copy, and the final state is
bitwise equal to the straight run's; 1 otherwise.

``goodput chaos CONFIG [KEY=VALUE ...] [options] [-- LAUNCH OPTIONS]``: argparse cannot put
options after a positional and still keep a ``--`` tail (it drops a ``--`` that follows a
positional at once), so everything from CONFIG on is taken whole and parsed here: CONFIG, the
overrides and the campaign options up to ``--``, by a parser of the same class (one-line
errors), and goodput launch's own options after it, by goodput launch's parser.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from goodput import argtypes
from goodput.commands import OneLineErrorParser, Subparsers, after_dashes, launch
from goodput.errors import ExitCode, GoodputError

if TYPE_CHECKING:
    from goodput.launch import LaunchOptions

# Launch options the campaign sets itself, each with where it is set instead.
OWN_LAUNCH_OPTIONS = {
    "nproc": "give --nproc before --",
    "run_dir": "the runs go under --output",
    "log": "each run's output goes to its launch.log under --output",
    "dry_run": "a campaign runs",
}


def register(groups: Subparsers) -> None:
    chaos = groups.add_parser(
        "chaos",
        help="train a config straight and again with seeded faults under goodput launch "
        "--auto-retry; report goodput, recovery and whether the final state is bitwise equal",
        description="Run CONFIG twice under goodput launch: straight, and with NUM faults "
        "injected at seeded steps (SIGKILL of a rank, SIGKILL during a checkpoint flush, "
        "SIGSTOP of a rank, a rank dying like a bad node, a failing save, a NaN gradient; with "
        "checkpoint.memory_interval_steps=K also SIGKILL during an in-memory checkpoint and a host "
        "lost with its snapshots; on --kinds also a slow rank and a stalled one, which the "
        "launcher must name) and --auto-retry on. Report each fault's detection, steps lost, "
        "where the restart loaded from and recovery time, the attempts, goodput and where the "
        "rest of the time went, and compare losses, weights, optimizer and RNG state bit for "
        "bit. Exit 0 only when they are equal (and, with in-memory checkpoints, each fault lost at "
        "most K steps).",
        usage="goodput chaos CONFIG [KEY=VALUE ...] [options] [-- LAUNCH OPTIONS]",
    )
    chaos.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        metavar="CONFIG [KEY=VALUE ...] [options] [-- LAUNCH OPTIONS]",
        help="the run config (TOML), overrides for both runs (as goodput train takes them), the "
        "options below, and after -- goodput launch options for both runs (--nhosts, --ppn, "
        "--profile, --timeout, --retries, --backoff, --grace, --no-prefix, --in-process, "
        "--spares-warm)",
    )
    add_campaign_options(chaos)
    # The options after CONFIG are parsed in the handler, --help among them.
    chaos.set_defaults(handler=_chaos, print_help=chaos.print_help)


def add_campaign_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--faults",
        type=argtypes.positive_int,
        default=8,
        metavar="NUM",
        help="faults to inject (default 8)",
    )
    parser.add_argument(
        "--seed",
        type=argtypes.non_negative_int,
        default=0,
        help="draws the faults' kinds, steps and ranks (default 0)",
    )
    parser.add_argument(
        "--kinds",
        type=_kinds,
        metavar="LIST",
        help="comma-separated, from kill,ckpt-kill,hang,bad-node,save-fail,nan,slow,stall,"
        "snapshot-kill,host-loss (default: all but slow and stall; bad-node and host-loss only "
        "when the launch has spare hosts; snapshot-kill and host-loss only with "
        "checkpoint.memory_interval_steps=K, host-loss on two hosts or more). slow and stall "
        "also check that the launcher names the faulted rank and host, which it names against "
        "its peers: they need two ranks or more",
    )
    parser.add_argument(
        "--nproc",
        type=argtypes.positive_int,
        help="ranks in all (default: goodput launch's)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        metavar="DIR",
        help="the campaign folder: both runs, the plans, report.json (default: chaos-STEM "
        "of the config)",
    )
    parser.add_argument(
        "--perturb",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for the faulted run only: a control that the comparison catches a "
        "real difference (the campaign must then exit 1)",
    )


def _kinds(text: str) -> tuple[str, ...]:
    from goodput.faults import KINDS

    kinds = tuple(text.split(","))
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{unknown[0]!r} is not a fault kind; choose from {','.join(KINDS)}"
        )
    if len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(f"{text!r} names a kind twice")
    return kinds


def _chaos(args: argparse.Namespace) -> ExitCode:
    from goodput.faults import MAX_FAULTS

    words, launch_argv = _split_at_dashes(after_dashes(args.rest))
    if {"-h", "--help"} & set(words):
        args.print_help()
        return ExitCode.OK
    tail = OneLineErrorParser(prog="goodput chaos", add_help=False)
    add_campaign_options(tail)
    tail.add_argument("config", type=Path)
    tail.add_argument("overrides", nargs="*", default=[])
    tail.parse_intermixed_args(words, namespace=args)
    if args.faults > MAX_FAULTS:
        raise GoodputError.usage(
            "--faults", f"{args.faults} is more than {MAX_FAULTS}", "ask for fewer"
        )
    from goodput.chaos.campaign import CampaignOptions, run_campaign
    from goodput.chaos.report import format_report

    report = run_campaign(
        CampaignOptions(
            config=args.config,
            overrides=tuple(args.overrides),
            perturb=tuple(args.perturb),
            num_faults=args.faults,
            seed=args.seed,
            kinds=args.kinds,
            output=args.output,
            launch=_launch_options(launch_argv, args.nproc),
        )
    )
    print(format_report(report), flush=True)
    return ExitCode.OK if report.passed else ExitCode.ERROR


def _split_at_dashes(rest: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in rest:
        return rest, []
    index = rest.index("--")
    return rest[:index], rest[index + 1 :]


def _launch_options(argv: list[str], nproc: int | None) -> LaunchOptions:
    """goodput launch's options after ``--``, as both runs take them (the command is chaos's)."""
    parsed, unknown = launch.parse(argv)
    fix = "after --, give goodput launch's options only (goodput launch --help)"
    if unknown or parsed.cmd:
        raise GoodputError.usage(
            "goodput chaos --",
            f"{' '.join(unknown or parsed.cmd)} is not a launch option here",
            fix,
        )
    for name, where in OWN_LAUNCH_OPTIONS.items():
        if getattr(parsed, name) not in (None, False):
            flag = "--" + name.replace("_", "-")
            raise GoodputError.usage(f"goodput chaos -- {flag}", "is the campaign's to set", where)
    return dataclasses.replace(launch.options(parsed), nproc=nproc)
