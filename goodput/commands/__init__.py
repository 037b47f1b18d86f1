"""The command groups of ``goodput``: one module per group, named as the group.

Each module has ``register(groups)``, which adds its group's parser to ``groups`` (the
subparsers of ``goodput``) and sets a ``handler`` default on every command it can run: a
function of the parsed options that calls into the part it fronts and returns an ``ExitCode``.
Handlers only check their options and print the result; they raise rather than print errors,
and ``goodput.cli.main`` turns whatever they raise into one line. Modules here import only
argparse and light helpers at module level; everything else is imported inside a handler, so
that ``goodput --help`` stays instant and ``goodput launch`` never imports torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from goodput.errors import MAX_WHAT_CHARS, ExitCode, one_line

Handler = Callable[[argparse.Namespace], ExitCode]


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's usage errors as one bounded ``goodput: error:`` line (exit 2), like every
    other error. Every parser of goodput's command lines is one: ``goodput``'s own (whose
    subparsers take their parent's class) and those a handler builds for the rest of its
    line (``goodput chaos``'s options after CONFIG, the goodput launch line of chaos and submit)."""

    def error(self, message: str) -> NoReturn:
        said = one_line(message, MAX_WHAT_CHARS)
        print(f"goodput: error: {self.prog}: {said}; see {self.prog} --help", file=sys.stderr)
        sys.exit(int(ExitCode.USAGE))


Subparsers = argparse._SubParsersAction  # what add_subparsers returns; argparse names it privately


def add_command(
    commands: Subparsers, name: str, handler: Handler, help_: str
) -> argparse.ArgumentParser:
    """A command of a group whose one-line help is also its description."""
    sub = commands.add_parser(name, help=help_, description=help_)
    sub.set_defaults(handler=handler)
    return sub


def after_dashes(argv: list[str]) -> list[str]:
    """An ``argparse.REMAINDER`` without the ``--`` that may open it."""
    return argv[1:] if argv[:1] == ["--"] else argv
