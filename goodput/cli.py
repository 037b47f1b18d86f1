"""The ``goodput`` command: the one error boundary, and the list of command groups.

Each group is a module of ``goodput.commands`` (its parser and one-call handlers); a new group is
a new module there and its name in ``GROUPS``. Every handler returns an ``ExitCode``; whatever
it raises leaves ``main`` as one line on stderr and a non-zero exit code, and argparse usage
errors exit 2 as one line too (``commands.OneLineErrorParser``, the class of every parser).
Heavy modules are imported inside handlers so that ``goodput --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import traceback
from collections.abc import Sequence

from goodput import __version__
from goodput.commands import OneLineErrorParser
from goodput.errors import ExitCode, from_exception

# In the order `goodput --help` lists them; each names its module in goodput.commands.
GROUPS = tuple(
    "data model plan train ckpt generate eval launch broadcast submit chaos diagnose report".split()
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="goodput", description="Pre-train LLMs on supercomputers and keep the run alive."
    )
    parser.add_argument("--version", action="version", version=f"goodput {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (or GOODPUT_DEBUG=1)"
    )
    groups = parser.add_subparsers(dest="group", required=True, metavar="GROUP")
    for name in GROUPS:
        importlib.import_module(f"goodput.commands.{name}").register(groups)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The one boundary: whatever a command raises leaves as one line and a non-zero code."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `goodput ... | head` ends quietly
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print("goodput: interrupted", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)
    except Exception as exc:
        if args.debug or os.environ.get("GOODPUT_DEBUG") == "1":
            traceback.print_exc()
        error = from_exception(exc)
        print(f"goodput: error: {error.render()}", file=sys.stderr, flush=True)
        return int(error.code)


if __name__ == "__main__":
    sys.exit(main())
