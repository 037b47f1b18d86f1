"""The attempt loop: run an attempt, classify it, decide, log it, wait, run the next.

One loop serves ``--retries R`` and ``--auto-retry``; a ``Policy`` says what differs. After every
attempt, in this order:
  1. it gets its class and steps gained (``failover.classify``, ``failover.steps_gained``);
  2. it stops on ``success``, ``walltime`` (the allocation is ending: continuing is the job
     chain's work, in a new allocation) and ``interrupted``, and on a usage error (exit 2),
     which the next attempt would repeat;
  3. it stops after ``max_stepless`` attempts in a row without a step, if the policy sets it (a
     config bug must not burn the spare pool);
  4. hosts are blamed: those an output line named (``patterns``), else, if the policy has a
     ``probe``, those whose health probe fails. It stops when a blamed host has no spare left;
  5. it stops once ``max_attempts`` attempts have run;
  6. otherwise the blamed hosts are swapped for spares, in place, and the next attempt starts
     after ``backoff_s * 2**k`` seconds (capped at ``backoff_max_s``) times a jitter factor in
     [0.5, 1], where k counts the failed attempts in a row since one made progress, so that
     the ranks of many jobs restarting at once do not stampede a file system or a scheduler.
Plain ``--retries R`` is ``Policy(max_attempts=R + 1)``: no patterns, no probe, no step-less
limit, so it never blames a host and retries on the same ones. Every attempt appends one
``history.AttemptRecord`` to the attempts log and prints one line, before the wait.
"""

from __future__ import annotations

import itertools
import math
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from goodput.errors import ExitCode
from goodput.launch import failover
from goodput.launch.attempt import AttemptResult
from goodput.launch.history import AttemptClass, AttemptRecord, Evidence, append_record, timestamp

EXIT_MEANINGS: dict[int, str] = {
    ExitCode.OK: "ok",
    ExitCode.ERROR: "error",
    ExitCode.USAGE: "usage or config error",
    ExitCode.IDLE_TIMEOUT: "idle watchdog",
    ExitCode.INTERRUPTED: "interrupted",
    ExitCode.TERMINATED: "terminated",
}
# Why the loop stops after an attempt of these classes.
FINAL_CLASSES: dict[AttemptClass, str] = {
    "success": "done",
    "walltime": "the allocation is ending; a job chain goes on in its next job",
    "interrupted": "interrupted (Ctrl-C): not retried",
}
# The attempt: its hosts, and a callable that must see each output line (None: no one looks).
StartAttempt = Callable[[tuple[str, ...], Callable[[bytes], None] | None], AttemptResult]
Probe = Callable[[tuple[str, ...]], dict[str, Evidence]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """What may change between attempts, and when to give up (the module docstring's rules)."""

    max_attempts: int | None  # None: no limit but the other rules
    backoff_s: float = 5.0
    backoff_max_s: float = 300.0
    patterns: tuple[str, ...] = ()  # output lines that name a bad host (``host``/``addr`` group)
    probe: Probe | None = None  # the hosts that fail a health probe, when no line named one
    max_stepless: int | None = None  # stop after this many attempts in a row without a step

    def __post_init__(self) -> None:
        # NaN fails every comparison: no wait the attempts log could not hold gets through.
        assert self.backoff_s >= 0 and 0 <= self.backoff_max_s < math.inf, self
        assert all(n is None or n >= 1 for n in (self.max_attempts, self.max_stepless)), self


@dataclass(frozen=True, slots=True)
class Decision:
    evidence: list[Evidence]
    replaced: dict[str, str]
    stop: str | None  # why the loop stops; None: it retries


def run_attempts(
    start_attempt: StartAttempt,
    policy: Policy,
    pool: failover.Pool,
    *,
    attempts_log: Path,
    heartbeat: Path | None = None,
    job: str | None = None,
    rng: random.Random | None = None,
    sleep: Callable[[float], object] = time.sleep,
    resolve: Callable[[str], list[str]] | None = None,
) -> int:
    """Run attempts on ``pool.active`` until a rule stops them; the last attempt's exit code."""
    rng = rng if rng is not None else random.Random()
    stepless = 0  # attempts in a row without a step
    failures = 0  # failed attempts since the last progress (the backoff doubles with it)
    for attempt in itertools.count(1):
        hosts = tuple(pool.active)
        scanner = failover.EvidenceScanner(policy.patterns, [*pool.active, *pool.spares], resolve)
        before = failover.read_heartbeat_step(heartbeat)
        started, clock = datetime.now(UTC), time.monotonic()
        result = start_attempt(hosts, scanner if policy.patterns else None)
        ended = started + timedelta(seconds=time.monotonic() - clock)
        gained = failover.steps_gained(result, before, heartbeat)
        named = [scanner.found[host] for host in hosts if host in scanner.found]
        kind = failover.classify(result, gained, named)
        stepless = stepless + 1 if gained == 0 else 0
        failures = 1 if gained else failures + 1
        decision = _decide(policy, pool, attempt, kind, result.exit_code, stepless, named)
        wait_s = None
        if decision.stop is None:  # rounded as logged, so the log says what was slept
            delay = backoff_delay(failures - 1, policy.backoff_s, policy.backoff_max_s, rng)
            wait_s = round(delay, 3)
        record = _record(
            attempt=attempt,
            policy=policy,
            job=job,
            hosts=hosts,
            spares_left=tuple(pool.spares),
            result=result,
            times=(started, ended),
            kind=kind,
            gained=gained,
            decision=decision,
            wait_s=wait_s,
        )
        append_record(attempts_log, record)
        _tell(record, result.duration_s)
        if wait_s is None:
            return result.exit_code
        try:
            sleep(wait_s)
        except KeyboardInterrupt:
            _say("interrupted while waiting to retry")
            return ExitCode.INTERRUPTED
    raise AssertionError("unreachable: the loop ends by returning")


def _decide(
    policy: Policy,
    pool: failover.Pool,
    attempt: int,
    kind: AttemptClass,
    exit_code: int,
    stepless: int,
    named: list[Evidence],
) -> Decision:
    """Rules 2-6 of the module docstring; swaps hosts in ``pool`` when it retries."""
    if kind in FINAL_CLASSES:
        return Decision(named, {}, FINAL_CLASSES[kind])
    if exit_code == ExitCode.USAGE:
        return Decision(named, {}, "usage or config error (exit 2): fix it, then relaunch")
    if policy.max_stepless is not None and stepless >= policy.max_stepless:
        return Decision(
            named,
            {},
            f"{stepless} attempts in a row made no step: a config or code error is likely; "
            "read the log above, fix it, then relaunch",
        )
    evidence = named
    if not named and policy.probe is not None:
        hosts = tuple(pool.active)
        _say(f"attempt {attempt}: {kind}, no host named; probing {len(hosts)} host(s)")
        evidence = sorted(policy.probe(hosts).values(), key=lambda e: hosts.index(e.host))
    bad = [item.host for item in evidence]
    if len(bad) > len(pool.spares):
        return Decision(
            evidence,
            {},
            f"no spare left for {', '.join(bad[len(pool.spares) :])} "
            f"({len(pool.spares)} spare(s) for {len(bad)} bad host(s))",
        )
    if attempt == policy.max_attempts:
        return Decision(evidence, {}, "no retries left")
    return Decision(evidence, pool.replace(bad), None)


def _record(
    *,
    attempt: int,
    policy: Policy,
    job: str | None,
    hosts: tuple[str, ...],
    spares_left: tuple[str, ...],
    result: AttemptResult,
    times: tuple[datetime, datetime],
    kind: AttemptClass,
    gained: int,
    decision: Decision,
    wait_s: float | None,
) -> AttemptRecord:
    started, ended = times
    return AttemptRecord(
        attempt=attempt,
        of=policy.max_attempts,
        job=job,
        class_=kind,
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        first_failure_label=result.first_failure_label,
        started=timestamp(started),
        first_step_at=_first_step_at(result, ended),
        ended=timestamp(ended),
        steps_seen=result.steps_seen,
        first_step=result.first_step,
        last_step=result.last_step,
        steps_gained=gained,
        hosts=hosts,
        evidence=tuple(decision.evidence),
        replaced=decision.replaced,
        spares_left=spares_left,
        decision="stop" if decision.stop is not None else "retry",
        reason=decision.stop,
        wait_s=wait_s,
    )


def _first_step_at(result: AttemptResult, ended: datetime) -> str | None:
    """The attempt's processes ran for the last ``duration_s`` before ``ended``."""
    if result.first_step_after_s is None:
        return None
    return timestamp(ended - timedelta(seconds=result.duration_s - result.first_step_after_s))


def _tell(record: AttemptRecord, duration_s: float) -> None:
    """The attempt's line on stderr: what it did, the evidence, and what comes next."""
    for item in record.evidence:
        _say(f"  {item.host}: {item.said.splitlines()[-1]} [{item.source}]")
    of = f" of {record.of}" if record.of is not None else ""
    said = (
        f"attempt {record.attempt}{of} exited {record.exit_code} "
        f"({describe_exit(record.exit_code)}) after {duration_s:.1f} s: {record.class_}, "
        f"{record.steps_gained} step(s) gained"
    )
    if record.wait_s is None:
        _say(f"{said}; {record.reason}")
        return
    changes = ", ".join(f"{old} -> {new}" for old, new in record.replaced.items())
    hosts = f"replaced {changes}" if changes else "same hosts"
    _say(f"{said}; {hosts}; retrying in {record.wait_s:.1f} s")


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


def _say(text: str) -> None:
    print(f"launch: {text}", file=sys.stderr, flush=True)
