"""``goodput train``: a run config (plus overrides) into ``goodput.train.loop.train``, as one
process or as every rank under a launcher. An error names the rank and its host."""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from goodput.commands import OneLineErrorParser, Subparsers
from goodput.errors import ExitCode, GoodputError, from_exception

if TYPE_CHECKING:
    from goodput.train.config.run import RunConfig


def register(groups: Subparsers) -> None:
    train = groups.add_parser(
        "train",
        help="train a model from a run config (single process or under any launcher)",
        description="Train from a TOML run config with [model] [train] [data] [optim] "
        "[schedule] [parallel] tables. Runs as one process, or as every rank under torchrun, "
        "srun or mpiexec; prints one step=N line per step.",
    )
    train.add_argument("config", type=Path, help="the run config (TOML)")
    train.add_argument(
        "overrides", nargs="*", help="section.key=value overrides, e.g. train.steps=100"
    )
    train.add_argument(
        "--resume",
        metavar="auto|never|PATH",
        help="auto: the newest complete checkpoint of the run, if any (default); never: start "
        "fresh; PATH: that checkpoint directory (same as checkpoint.resume=...)",
    )
    train.add_argument(
        "--allow-data-change",
        action="store_true",
        help="resume even though the data fingerprint differs from the checkpoint's",
    )
    train.set_defaults(handler=_train)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """``goodput train ARGV`` parsed as the command parses it (argparse's own errors: one line,
    exit 2), and the arguments it does not know."""
    parser = OneLineErrorParser(prog="goodput")
    register(parser.add_subparsers())
    return parser.parse_known_args(["train", *argv])


def load_run_config(args: argparse.Namespace) -> RunConfig:
    """The run config ``goodput train ARGS`` trains (its options are overrides too); torch-free,
    for ``goodput submit`` to check a chain's line with."""
    from goodput.config import load_config
    from goodput.train.config.run import RunConfig

    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={json.dumps(args.resume)}")
    if args.allow_data_change:
        overrides.append("checkpoint.allow_data_change=true")
    return load_config(RunConfig, args.config, overrides)


def _train(args: argparse.Namespace) -> ExitCode:
    cfg = load_run_config(args)  # torch-free: a config error is one line, without torch's import
    from goodput.ranks import RECOVERY_STORE_VAR
    from goodput.train.loop import train

    try:
        if RECOVERY_STORE_VAR in os.environ:  # goodput launch --in-process
            from goodput.train.recovery import train_in_process

            train_in_process(train, cfg)
        else:
            train(cfg)
    except Exception as error:
        # The line names the rank and its host, for the person reading the log and for
        # `goodput launch --auto-retry`, which swaps the host out on a device error.
        raise from_exception(error, context=_rank_on_host()) from error
    return ExitCode.OK


def _rank_on_host() -> str:
    from goodput.launch.env import current_placement

    try:
        rank = str(current_placement().rank)
    except GoodputError:
        rank = "?"
    return f"rank {rank} on {socket.gethostname()}"
