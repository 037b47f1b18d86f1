"""Exit codes and the one user-facing error type.

Every failure a user can fix is a ``GoodputError``: it names *where* (a file, a file:line, a config
field), *what* went wrong and the *fix*, and renders as one line. ``assert`` is kept for
invariants of our own code, never for user input. ``from_exception`` is the one boundary's
translation: whatever escapes a command (an OS error, a bug) still reaches the user as one line.
``warn_deprecated`` is the one line a renamed option or config key prints while its old
spelling still works (one release).

Bounded. Messages quote user data (paths, option values, JSON fragments) of any length, so
``one_line`` folds every run of whitespace to one space and keeps at most ``limit`` characters,
eliding the middle (the head and tail of a path say which it is); ``render`` bounds each part,
so a rendered error is one line of at most ``MAX_RENDERED_CHARS`` characters, whatever it quotes.
"""

from __future__ import annotations

import enum
import errno
import sys

ELISION = " ... "
MAX_WHERE_CHARS = 300
MAX_WHAT_CHARS = 500
MAX_FIX_CHARS = 300
MAX_RENDERED_CHARS = MAX_WHERE_CHARS + MAX_WHAT_CHARS + MAX_FIX_CHARS + len(": ; ")


class ExitCode(enum.IntEnum):
    """Process exit codes shared by every goodput command and the launcher's classifier."""

    OK = 0
    ERROR = 1
    USAGE = 2  # bad command line or config
    NOT_LEARNING = 3  # the eval gate stopped the run ([eval] stop_on_alarm)
    STRAGGLER = 4  # stopped after a save, to replace a straggler's host (--evict-stragglers)
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
        """``where: what; fix`` as one line of at most ``MAX_RENDERED_CHARS`` characters."""
        where = one_line(self.where, MAX_WHERE_CHARS)
        what = one_line(self.what, MAX_WHAT_CHARS)
        return f"{where}: {what}; {one_line(self.fix, MAX_FIX_CHARS)}"


def one_line(text: str, limit: int) -> str:
    """``text`` with each run of whitespace (newlines too) as one space, at most ``limit``
    characters: a longer text keeps its head and tail around ``ELISION``."""
    assert limit > len(ELISION) + 1
    line = " ".join(str(text).split())
    if len(line) <= limit:
        return line
    head = (limit - len(ELISION) + 1) // 2
    tail = limit - len(ELISION) - head
    return f"{line[:head]}{ELISION}{line[len(line) - tail :]}"


def printable(text: str, limit: int) -> str:
    """``text`` with every character that is not printable (control bytes, newlines, NUL) as
    ``?``, at most ``limit`` characters: what another process wrote, safe in one line."""
    return "".join(ch if ch.isprintable() else "?" for ch in text[:limit])


def warn_deprecated(old: str, new: str) -> None:
    """The one warning line for a spelling still read for one release: ``old`` works as ``new``."""
    print(f"goodput: warning: {old} is deprecated; use {new}", file=sys.stderr, flush=True)


def _rebuild(where: str, what: str, fix: str, code: ExitCode) -> GoodputError:
    return GoodputError(where, what, fix, code=code)


# What to do about the OS errors a user's paths run into; any other errno gets the generic fix.
OS_ERROR_FIXES = {
    errno.ENOENT: "check the path",
    errno.EACCES: "check the permissions of the path and its folders",
    errno.EPERM: "check the permissions of the path and its folders",
    errno.EISDIR: "pass a file, not a folder",
    errno.ENOTDIR: "a part of the path is a file where a folder should be; fix the path",
    errno.EEXIST: "remove it or choose another path",
    errno.ENOTEMPTY: "remove it or choose another path",
    errno.ENOSPC: "free space on that filesystem, or write elsewhere",
    errno.EDQUOT: "free space in your quota, or write elsewhere",
    errno.EROFS: "the filesystem is read-only; write elsewhere",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.ELOOP: "the path has a symbolic link loop; fix the link",
    errno.EFBIG: "the file is larger than allowed here (ulimit -f); write elsewhere",
}
DEBUG_HINT = "rerun with GOODPUT_DEBUG=1 (or goodput --debug) for the traceback, and report it"


def from_exception(exc: BaseException, context: str = "") -> GoodputError:
    """``exc`` as one line: a ``GoodputError`` as it is; an OS error names its path and the fix;
    anything else names its type. ``context`` (e.g. "rank 3 on nid0042") goes first."""
    if isinstance(exc, GoodputError):
        return exc
    prefix = f"{context}: " if context else ""
    if isinstance(exc, OSError) and (exc.strerror or exc.filename):
        path = "" if exc.filename is None else str(exc.filename)
        if exc.filename2 is not None:
            path += f" -> {exc.filename2}"
        fix = OS_ERROR_FIXES.get(exc.errno or 0, "check the path and its filesystem")
        return GoodputError(f"{prefix}{path or 'a file'}", exc.strerror or str(exc), fix)
    if isinstance(exc, MemoryError):
        return GoodputError(
            f"{prefix}goodput", "out of memory", "give it smaller input or a larger machine"
        )
    if isinstance(exc, RecursionError):
        return GoodputError(f"{prefix}goodput", "input nested too deeply", DEBUG_HINT)
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return GoodputError(f"{prefix}goodput", f"{type(exc).__name__}: {first_line}", DEBUG_HINT)
