"""Retry failed attempts with capped exponential backoff, and log every attempt.

``run_with_retries`` runs attempt 0 and, while an attempt exits non-zero, up to ``retries`` more,
sleeping ``backoff_s * 2**k`` (capped at ``backoff_max_s``) times a jitter factor in [0.5, 1]
before retry ``k``, so that ranks of many jobs restarting at once do not stampede a file system
or a scheduler. Exits that no retry can help are returned at once (``NOT_RETRIED``):
  - 130: a person pressed Ctrl-C;
  - 143: someone outside — usually the scheduler at walltime, or ``scancel`` — asked the job to
    stop, either the launcher itself (forwarded to its processes) or the processes directly.
    The allocation is going away; a new attempt would be killed while it starts. Continuing
    is the job chain's work, in a new allocation;
  - 2: a usage or config error, which the next attempt would repeat.
Each attempt appends one JSON line to ``attempts_log`` (``attempt`` counts from 1, as the
messages do), written with a single ``write`` and fsynced, so a crash never leaves half a line.
Classifying why an attempt failed and replacing hosts is ``failover``'s (``--auto-retry``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from goodput.errors import ExitCode
from goodput.launch.attempt import AttemptResult

NOT_RETRIED = frozenset({ExitCode.USAGE, ExitCode.INTERRUPTED, ExitCode.TERMINATED})
EXIT_MEANINGS: dict[int, str] = {
    ExitCode.ERROR: "error",
    ExitCode.USAGE: "usage or config error",
    ExitCode.IDLE_TIMEOUT: "idle watchdog",
    ExitCode.INTERRUPTED: "interrupted",
    ExitCode.TERMINATED: "terminated",
}


def run_with_retries(
    start_attempt: Callable[[int], AttemptResult],
    *,
    retries: int,
    backoff_s: float = 5.0,
    backoff_max_s: float = 300.0,
    attempts_log: Path | None,
    rng: random.Random | None = None,
    sleep: Callable[[float], object] = time.sleep,
) -> int:
    """Run ``start_attempt(0)``, ``start_attempt(1)``, ... until one succeeds or may not be
    retried, or ``retries`` retries are spent; return the last attempt's exit code."""
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    rng = rng if rng is not None else random.Random()
    num_attempts = retries + 1
    for index in range(num_attempts):
        started = now()
        result = start_attempt(index)
        if attempts_log is not None:
            append_line(attempts_log, _record(result, index + 1, num_attempts, started, now()))
        code = result.exit_code
        if code == ExitCode.OK:
            return code
        said = (
            f"launch: attempt {index + 1} of {num_attempts} exited {code} ({describe_exit(code)})"
            f" after {result.duration_s:.1f} s"
        )
        if code in NOT_RETRIED or index == retries:
            why = "not retried" if code in NOT_RETRIED else "no retries left"
            print(f"{said}; {why}", file=sys.stderr, flush=True)
            return code
        delay = backoff_delay(index, backoff_s, backoff_max_s, rng)
        print(f"{said}; retrying in {delay:.1f} s", file=sys.stderr, flush=True)
        try:
            sleep(delay)
        except KeyboardInterrupt:
            print("launch: interrupted while waiting to retry", file=sys.stderr)
            return ExitCode.INTERRUPTED
    raise AssertionError("unreachable: the last attempt always returns")


def backoff_delay(retry: int, backoff_s: float, backoff_max_s: float, rng: random.Random) -> float:
    """Seconds to wait before retry number ``retry`` (from 0): capped doubling, jittered down."""
    return min(backoff_s * 2.0**retry, backoff_max_s) * rng.uniform(0.5, 1.0)


def describe_exit(code: int) -> str:
    if code in EXIT_MEANINGS:
        return EXIT_MEANINGS[code]
    if code > 128:
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return "error"


def append_line(path: Path, record: dict[str, object]) -> None:
    """Append one complete JSON line durably: one ``write`` on an O_APPEND descriptor, fsynced."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(f"short write to {path}: {written} of {len(line)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)


def _record(
    result: AttemptResult, attempt: int, num_attempts: int, started: datetime, ended: datetime
) -> dict[str, object]:
    return {
        "attempt": attempt,
        "of": num_attempts,
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "first_failure_label": result.first_failure_label,
        "duration_s": round(result.duration_s, 3),
        "steps_seen": result.steps_seen,
        "last_step": result.last_step,
        "started": started.isoformat(timespec="milliseconds"),
        "ended": ended.isoformat(timespec="milliseconds"),
    }


def now() -> datetime:
    return datetime.now(UTC)
