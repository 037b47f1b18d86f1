"""``goodput diagnose``: questions answered by running the real trainer. ``smoke`` records a
config's per-step numbers, or compares them bit for bit with a baseline (``goodput.diagnostics``
does the work)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from goodput import argtypes
from goodput.commands import Subparsers, add_command
from goodput.errors import ExitCode

DEFAULT_STEPS = 50  # with --record; a baseline knows its own count


def register(groups: Subparsers) -> None:
    diagnose = groups.add_parser(
        "diagnose",
        help="check what the trainer does with a config: the bit-exact smoke gate",
        description="Run the real trainer on a config to answer one question about it and the "
        "software under it.",
    )
    commands = diagnose.add_subparsers(dest="command", required=True, metavar="COMMAND")
    smoke = add_command(
        commands,
        "smoke",
        _smoke,
        "run a config for a few steps as one rank and record each step's loss, gradient norm "
        "and peak memory (--record), or compare them with a baseline (--baseline): bit for bit "
        "on CPU; exit 1 at the first step and metric that differ",
    )
    smoke.add_argument("config", type=Path, help="the run config (TOML)")
    smoke.add_argument(
        "overrides", nargs="*", help="section.key=value overrides, e.g. data.file_list=..."
    )
    mode = smoke.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", type=Path, metavar="FILE", help="write the smoke record here")
    mode.add_argument(
        "--baseline", type=Path, metavar="FILE", help="compare with this smoke record"
    )
    smoke.add_argument(
        "--steps",
        type=argtypes.positive_int,
        help=f"steps to run (default: {DEFAULT_STEPS} with --record, the baseline's with "
        "--baseline)",
    )


def _smoke(args: argparse.Namespace) -> ExitCode:
    from goodput.diagnostics import smoke

    if args.record is not None:
        steps = DEFAULT_STEPS if args.steps is None else args.steps
        print(smoke.record(args.config, args.overrides, steps, args.record), flush=True)
        return ExitCode.OK
    code, line = smoke.check(args.config, args.overrides, args.steps, args.baseline)
    print(line, file=sys.stdout if code == ExitCode.OK else sys.stderr, flush=True)
    return code
