"""``goodput model``: what the [model] table of a config amounts to (``goodput.train.info``);
allocates nothing."""

from __future__ import annotations

import argparse
from pathlib import Path

from goodput import argtypes
from goodput.commands import Subparsers
from goodput.errors import ExitCode


def register(groups: Subparsers) -> None:
    model = groups.add_parser(
        "model", help="inspect model configs", description="Model configs: sizes, FLOPs, memory."
    )
    commands = model.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = commands.add_parser(
        "info",
        help="parameters (total/active), FLOPs per token and training memory per "
        "precision policy of the [model] table of a config",
        description="Parameters (total/active), FLOPs per token (6N + attention term) and "
        "training memory per parameter for each precision policy. Allocates nothing.",
    )
    info.add_argument("config", type=Path, help="a TOML file with a [model] table")
    info.add_argument("overrides", nargs="*", help="key=value overrides inside [model]")
    info.add_argument(
        "--seq-len", type=argtypes.positive_int, help="default: the config's max_seq_len"
    )
    info.add_argument("--json", action="store_true")
    info.set_defaults(handler=_info)


def _info(args: argparse.Namespace) -> ExitCode:
    from goodput.config import load_section
    from goodput.io import print_json
    from goodput.train.config.model import ModelConfig
    from goodput.train.info import describe, format_description

    cfg = load_section(ModelConfig, args.config, "model", args.overrides)
    info = describe(cfg, args.seq_len or cfg.max_seq_len)
    if args.json:
        print_json(info, where="goodput model info --json", indent=2)
    else:
        print(format_description(str(args.config), info))
    return ExitCode.OK
