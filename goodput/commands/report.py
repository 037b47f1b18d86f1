"""``goodput report RUN_DIR``: where a run's wall time went (goodput, badput by cause, attempts),
from the run directory alone: a terminal summary, ``--json``, ``--html`` with the plots, and
``--watch`` to follow a run that is going on. ``goodput report RUN_A RUN_B ...`` (two or more)
compares the runs at matched tokens instead (``report.compare``): the same three views of their
series and of where each first reaches another's final value. It reads the runs and writes only
``--html``'s file, which ``goodput.outputs`` keeps out of run directories and off any file but a
page of ours."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from goodput import argtypes
from goodput.commands import Subparsers
from goodput.errors import ExitCode

WATCH_INTERVAL_S = 10.0


def register(groups: Subparsers) -> None:
    report = groups.add_parser(
        "report",
        help="where a run's hours went: goodput, badput by cause, attempts, plots",
        description="Stitch every job and attempt of a run (attempts.jsonl, metrics.jsonl, "
        "evals.jsonl, run.json, checkpoints) into one account: goodput = productive, preserved "
        "step time / wall time, and the badput by cause. Two or more runs: their loss, held-out "
        "loss and eval accuracy at matched tokens, and where each first reaches another's final "
        "value (docs/report.md).",
    )
    report.set_defaults(handler=_report)
    report.add_argument(
        "run_dirs",
        type=Path,
        nargs="+",
        metavar="RUN_DIR",
        help="a run directory; two or more: compare the runs at matched tokens",
    )
    report.add_argument(
        "--html", type=Path, metavar="OUT.html", help="also write the report with its plots"
    )
    report.add_argument("--json", action="store_true", help="print the account as one JSON object")
    report.add_argument(
        "--watch",
        action="store_true",
        help="refresh the summary while the run goes on, until it is done (Ctrl-C stops)",
    )
    report.add_argument(
        "--every",
        type=argtypes.positive_float,
        default=WATCH_INTERVAL_S,
        metavar="S",
        help=f"with --watch: seconds between refreshes (default {WATCH_INTERVAL_S:g})",
    )


def _report(args: argparse.Namespace) -> ExitCode:
    from rich.console import Console

    from goodput.report.accounting import account
    from goodput.report.run_files import read_run
    from goodput.report.terminal import summary

    if args.watch and args.json:
        from goodput.errors import GoodputError

        raise GoodputError.usage("--watch", "cannot be used with --json", "pick one")
    if args.html is not None:
        from goodput.outputs import HTML_REPORT, check_output_file

        check_output_file(args.html, HTML_REPORT, "--html", args.run_dirs)
    if len(args.run_dirs) > 1:
        return _compare(args)
    run_dir = args.run_dirs[0]
    run = read_run(run_dir)
    acc = account(run)
    if args.html is not None:
        from goodput.report.html import write_html

        write_html(run, acc, args.html)
    if args.json:
        from goodput.io import print_json

        print_json(acc.as_json(), where="goodput report --json")
        return ExitCode.OK
    console = Console()
    if not args.watch:
        console.print(summary(run, acc))
        if args.html is not None:
            console.print(f"report: {args.html}")
        return ExitCode.OK
    from rich.live import Live

    with Live(summary(run, acc), console=console, auto_refresh=False) as live:
        while not run.done:
            time.sleep(args.every)
            run = read_run(run_dir)
            live.update(summary(run, account(run, now=time.time())), refresh=True)
    return ExitCode.OK


def _compare(args: argparse.Namespace) -> ExitCode:
    """Two or more runs at matched tokens: the table, ``--json`` or ``--html``."""
    from rich.console import Console

    from goodput.errors import GoodputError
    from goodput.report.compare import compare_runs
    from goodput.report.compare_views import (
        comparison_json,
        comparison_summary,
        write_comparison_html,
    )

    if args.watch:
        raise GoodputError.usage("--watch", "follows one run, not a comparison", "pass one run")
    comparison = compare_runs(args.run_dirs)
    if args.html is not None:
        write_comparison_html(comparison, args.html)
    if args.json:
        from goodput.io import print_json

        print_json(comparison_json(comparison), where="goodput report --json")
        return ExitCode.OK
    console = Console()
    console.print(comparison_summary(comparison))
    if args.html is not None:
        console.print(f"report: {args.html}")
    return ExitCode.OK
