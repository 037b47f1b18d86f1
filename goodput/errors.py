"""Exit codes and the one user-facing error type.

Every failure a user can fix is a ``GoodputError``: it names *where* (a file, a file:line, a config
field), *what* went wrong and the *fix*, and renders as one line. ``assert`` is kept for
invariants of our own code, never for user input.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes shared by every goodput command and the launcher's classifier."""

    OK = 0
    ERROR = 1
    USAGE = 2  # bad command line or config
    IDLE_TIMEOUT = 124  # stdout-idle watchdog fired
    INTERRUPTED = 130  # SIGINT / Ctrl-C
    TERMINATED = 143  # SIGTERM, usually the scheduler's walltime


class GoodputError(Exception):
    """A user-fixable failure, rendered as ``where: what; fix``."""

    def __init__(self, where: object, what: str, fix: str, *, code: ExitCode = ExitCode.ERROR):
        self.where = str(where)
        self.what = what
        self.fix = fix
        self.code = code
        super().__init__(self.render())

    @classmethod
    def usage(cls, where: object, what: str, fix: str) -> GoodputError:
        """A bad command line, option or config: exit 2."""
        return cls(where, what, fix, code=ExitCode.USAGE)

    def __reduce__(self) -> tuple:  # type: ignore[type-arg]
        # Worker processes raise these; pickling must rebuild the parts, not the rendered line.
        return (_rebuild, (self.where, self.what, self.fix, self.code))

    def render(self) -> str:
        line = f"{self.where}: {self.what}; {self.fix}"
        # One line, always: messages quote user data (file names, JSON fragments).
        return " ".join(line.split())


def _rebuild(where: str, what: str, fix: str, code: ExitCode) -> GoodputError:
    return GoodputError(where, what, fix, code=code)
