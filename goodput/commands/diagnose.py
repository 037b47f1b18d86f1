"""``goodput diagnose``: questions answered by running the real trainer or reading its run.
``smoke`` records a config's per-step numbers in a layout, or compares them with a baseline;
``lr-find`` runs the LR range test on a fresh model of a config; ``batch-size`` reads a run's
gradient noise scale against its global batch (``goodput.diagnose`` does the work)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from goodput import argtypes
from goodput.commands import Subparsers, add_command
from goodput.errors import ExitCode

DEFAULT_STEPS = 50  # with --record; a baseline knows its own count
LR_FIND_STEPS = 200  # Adam's second moment lags ~1/(1 - beta2) steps: a ramp needs many more
LR_FIND_MIN_LR = 1e-7  # fastai's range
LR_FIND_MAX_LR = 10.0


def register(groups: Subparsers) -> None:
    diagnose = groups.add_parser(
        "diagnose",
        help="check what the trainer does with a config: the bit-exact smoke gate, the LR range "
        "test (lr-find), a run's gradient noise scale against its batch (batch-size)",
        description="Run the real trainer on a config, or read a run it wrote, to answer one "
        "question about it and the software under it.",
    )
    commands = diagnose.add_subparsers(dest="command", required=True, metavar="COMMAND")
    smoke = add_command(
        commands,
        "smoke",
        _smoke,
        "run a config for a few steps under goodput launch (--nproc local ranks, the layout of "
        "its [parallel] table) and record each step's loss, gradient norm and peak memory "
        "(--record), or compare them with a baseline (--baseline): bit for bit on CPU in the "
        "baseline's layout, to the layouts' tolerance in another against a one-process "
        "baseline; exit 1 at the first step and metric that differ",
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
    smoke.add_argument(
        "--nproc",
        type=argtypes.positive_int,
        help="local ranks to run on, under goodput launch (default: 1 with --record, the "
        "baseline's with --baseline)",
    )
    _register_lr_find(commands)
    _register_batch_size(commands)


def _register_lr_find(commands: Subparsers) -> None:
    lr_find = add_command(
        commands,
        "lr-find",
        _lr_find,
        "the LR range test: train a fresh model of a config while the LR ramps exponentially "
        "from --min-lr to --max-lr, stop at the cliff, and name the plateau, basin and cliff "
        "regions and a suggested LR; writes <train.run_dir>/lr_find.json",
    )
    lr_find.add_argument("config", type=Path, help="the run config (TOML)")
    lr_find.add_argument(
        "overrides", nargs="*", help="section.key=value overrides, e.g. train.run_dir=..."
    )
    lr_find.add_argument(
        "--steps",
        type=argtypes.positive_int,
        default=LR_FIND_STEPS,
        help=f"steps of the ramp, at least 10 (default: {LR_FIND_STEPS})",
    )
    lr_find.add_argument(
        "--min-lr",
        type=argtypes.positive_float,
        default=LR_FIND_MIN_LR,
        help=f"the first step's LR (default: {LR_FIND_MIN_LR:g})",
    )
    lr_find.add_argument(
        "--max-lr",
        type=argtypes.positive_float,
        default=LR_FIND_MAX_LR,
        help=f"the last step's LR (default: {LR_FIND_MAX_LR:g})",
    )
    lr_find.add_argument(
        "--json", action="store_true", help="print the result as one JSON object, nothing else"
    )
    lr_find.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="also draw the curve and regions to a PNG"
    )


def _register_batch_size(commands: Subparsers) -> None:
    batch_size = add_command(
        commands,
        "batch-size",
        _batch_size,
        "read a run's gradient noise scale (the gns of its metrics.jsonl) and say what it "
        "implies for its global batch: the steps and data it costs against their minima, and "
        "the recommended range",
    )
    batch_size.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory")
    batch_size.add_argument(
        "--json", action="store_true", help="print the report as one JSON object"
    )


def _smoke(args: argparse.Namespace) -> ExitCode:
    from goodput.diagnose import smoke

    if args.record is not None:
        from goodput.outputs import SMOKE_RECORD, check_output_file

        check_output_file(args.record, SMOKE_RECORD, "--record", [args.config])
        steps = DEFAULT_STEPS if args.steps is None else args.steps
        nproc = 1 if args.nproc is None else args.nproc
        print(smoke.record(args.config, args.overrides, steps, nproc, args.record), flush=True)
        return ExitCode.OK
    code, line = smoke.check(args.config, args.overrides, args.steps, args.nproc, args.baseline)
    print(line, file=sys.stdout if code == ExitCode.OK else sys.stderr, flush=True)
    return code


def _lr_find(args: argparse.Namespace) -> ExitCode:
    from goodput.config import load_config
    from goodput.diagnose.lr_find import RampSettings, lr_find
    from goodput.train.config.run import RunConfig

    settings = RampSettings(num_steps=args.steps, min_lr=args.min_lr, max_lr=args.max_lr)
    cfg = load_config(RunConfig, args.config, args.overrides)
    if args.plot is not None:
        _require_plot_path(args.plot, [args.config, Path(cfg.train.run_dir)])
    if args.json:  # stdout holds the one JSON object: the builders' lines go to stderr
        with contextlib.redirect_stdout(sys.stderr):
            result = lr_find(cfg, settings)
    else:
        result = lr_find(cfg, settings, lambda line: print(line, flush=True))
    if result is None:  # not rank 0
        return ExitCode.OK
    if args.plot is not None:
        from goodput.diagnose.plots import lr_find_plot

        lr_find_plot(result, args.plot)
    if args.json:
        from goodput.io import print_json

        print_json(result.as_json(), where="goodput diagnose lr-find --json")
    else:
        for line in result.summary():
            print(line, flush=True)
        if args.plot is not None:
            print(f"lr-find: plot in {args.plot}", flush=True)
    return ExitCode.OK


def _require_plot_path(path: Path, inputs: list[Path]) -> None:
    """Before anything runs: a plot that could not be written would waste the whole ramp, and
    one that would replace a file of the run or the config, or any file but a plot of ours, is
    refused (``goodput.outputs``)."""
    from goodput.errors import GoodputError
    from goodput.outputs import PNG_PLOT, check_output_file

    if path.suffix.lower() != ".png":
        raise GoodputError.usage("--plot", f"{path} is not a .png file", "name a FILE.png")
    if not path.parent.is_dir():
        raise GoodputError.usage(
            "--plot", f"the folder of {path} does not exist", "create it, or name another file"
        )
    check_output_file(path, PNG_PLOT, "--plot", inputs)


def _batch_size(args: argparse.Namespace) -> ExitCode:
    from goodput.diagnose.batch_size import report

    found = report(args.run_dir)
    if args.json:
        from goodput.io import print_json

        print_json(found.as_json(), where="goodput diagnose batch-size --json")
    else:
        for line in found.lines():
            print(line, flush=True)
    return ExitCode.OK
