"""The attempt loop: run an attempt, classify it, decide, log it, wait, run the next.

One loop serves ``--retries R`` and ``--auto-retry``; a ``Policy`` says what differs. After every
attempt, in this order:
  1. it gets its class and progress (``failover.classify``, ``failover.progress``);
  2. it stops on ``success``, ``walltime`` (the allocation is ending: continuing is the job
     chain's work, in a new allocation) and ``interrupted``, on a usage error (exit 2),
     which the next attempt would repeat, and on the eval gate's stop (exit 3: the run is not
     learning; a retry resumes into the same state);
  3. it stops after ``max_stepless`` attempts in a row without a step, if the policy sets it (a
     config bug must not burn the spare pool);
  4. it judges the hosts (``failover`` says what host and peer evidence are):
       host evidence names H             H is bad (source ``log``), without a probe: the line
                                         says enough, and explains the peers' lines too
       only peer evidence names H        H is probed: failed, H is bad (source ``probe``, the
                                         peer line kept with the answer); passed, H is kept,
                                         and the attempt's stderr line says so
       no evidence, the policy probes    every active host is probed; the failed are bad
       no evidence, no probe             no host is bad
     It stops when a bad host has no spare left. Peer evidence alone never makes a host bad,
     so it never stops a run for want of a spare: a single-host run (local ranks, one node)
     whose rank died retries on the same host;
  5. it stops once ``max_attempts`` attempts have run;
  6. otherwise the bad hosts are swapped for spares, in place, and the next attempt starts
     after a wait. Backoff protects the scheduler and the file systems from crash loops; it
     must not punish progress. An attempt made progress when it reached a step that no
     earlier attempt of this launch reached (by its ``step=`` lines or the heartbeat):
       - after progress: at most ``PROGRESS_WAIT_S`` (1 s, ``backoff_s`` if smaller), jittered;
       - after k attempts in a row without progress — no step at all, or the same crash at the
         same step again: ``backoff_s * 2**(k-1)``, capped at ``backoff_max_s``;
     each times a jitter factor in [0.5, 1], so that the ranks of many jobs restarting at once
     do not stampede a file system or a scheduler.
Plain ``--retries R`` is ``Policy(max_attempts=R + 1)``: no patterns, no probe, no step-less
limit, so it never blames a host and retries on the same ones, with the same waits. Every
attempt appends one ``history.AttemptRecord`` to the attempts log and prints one line, before
the wait.
"""

from __future__ import annotations

import dataclasses
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
    ExitCode.NOT_LEARNING: "stopped by the eval gate",
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
Probe = Callable[[tuple[str, ...]], dict[str, Evidence]]  # the hosts that failed, with why
PROGRESS_WAIT_S = 1.0  # the longest wait after an attempt that made progress
MAX_DOUBLINGS = 64  # 2**64 x any backoff is past the cap: no float overflow however long it runs


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """What may change between attempts, and when to give up (the module docstring's rules)."""

    max_attempts: int | None  # None: no limit but the other rules
    backoff_s: float = 5.0
    backoff_max_s: float = 300.0
    patterns: tuple[str, ...] = ()  # host evidence: lines that name a bad host
    peer_patterns: tuple[str, ...] = ()  # peer evidence: lines that name a host to probe
    probe: Probe | None = None  # the hosts that fail a health probe
    max_stepless: int | None = None  # stop after this many attempts in a row without a step

    def __post_init__(self) -> None:
        # NaN fails every comparison: no wait the attempts log could not hold gets through.
        assert self.backoff_s >= 0 and 0 <= self.backoff_max_s < math.inf, self
        assert all(n is None or n >= 1 for n in (self.max_attempts, self.max_stepless)), self


@dataclass(frozen=True, slots=True)
class Decision:
    evidence: list[Evidence]  # why each bad host is bad
    replaced: dict[str, str]
    stop: str | None  # why the loop stops; None: it retries
    cleared: list[Evidence] = dataclasses.field(default_factory=list)  # peer lines, probe passed


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
    """Run attempts on ``pool.active`` until a rule stops them; the last attempt's exit code.
    ``heartbeat``: the trainer's heartbeat file, as ``goodput launch`` asks the trainer to keep."""
    rng = rng if rng is not None else random.Random()
    stepless = 0  # attempts in a row without a step
    without_progress = 0  # attempts in a row that reached no new step: the backoff doubles
    furthest: int | None = None  # the highest step an attempt of this launch reached
    watch = bool(policy.patterns or policy.peer_patterns)
    for attempt in itertools.count(1):
        hosts = tuple(pool.active)
        scanner = failover.EvidenceScanner(
            policy.patterns, [*pool.active, *pool.spares], resolve, policy.peer_patterns
        )
        before = failover.read_heartbeat(heartbeat)
        started, clock = datetime.now(UTC), time.monotonic()
        result = start_attempt(hosts, scanner if watch else None)
        ended = started + timedelta(seconds=time.monotonic() - clock)
        reached = failover.progress(result, before, failover.read_heartbeat(heartbeat))
        progressed = reached.last_step is not None and (
            furthest is None or reached.last_step > furthest
        )
        furthest = reached.last_step if progressed else furthest
        stepless = 0 if reached.steps_gained else stepless + 1
        without_progress = 0 if progressed else without_progress + 1
        named = [scanner.found[host] for host in hosts if host in scanner.found]
        suspected = [
            scanner.suspected[host]
            for host in hosts
            if host in scanner.suspected and host not in scanner.found
        ]
        kind = failover.classify(result, reached.steps_gained, named)
        decision = _decide(
            policy, pool, attempt, kind, result.exit_code, stepless, named, suspected
        )
        if kind in ("error", "stuck-pre-training") and decision.evidence:
            kind = "bad-node"  # a crash whose suspect then failed its health probe
        wait_s = None
        if decision.stop is None:  # rounded as logged, so the log says what was slept
            delay = restart_delay(without_progress, policy.backoff_s, policy.backoff_max_s, rng)
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
            gained=reached.steps_gained,
            decision=decision,
            wait_s=wait_s,
        )
        append_record(attempts_log, record)
        _tell(record, result.duration_s, decision.cleared, None if progressed else furthest)
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
    suspected: list[Evidence],
) -> Decision:
    """Rules 2-6 of the module docstring; swaps hosts in ``pool`` when it retries. ``named``:
    host evidence against active hosts; ``suspected``: peer evidence against active hosts that
    no host evidence names."""
    if kind in FINAL_CLASSES:
        return Decision(named, {}, FINAL_CLASSES[kind])
    if exit_code == ExitCode.USAGE:
        return Decision(named, {}, "usage or config error (exit 2): fix it, then relaunch")
    if exit_code == ExitCode.NOT_LEARNING:
        return Decision(
            named, {}, "the eval gate stopped the run (exit 3): a retry would not learn either"
        )
    if policy.max_stepless is not None and stepless >= policy.max_stepless:
        return Decision(
            named,
            {},
            f"{stepless} attempts in a row made no step: a config or code error is likely; "
            "read the log above, fix it, then relaunch",
        )
    bad, cleared = _judge_hosts(policy, tuple(pool.active), attempt, kind, named, suspected)
    if len(bad) > len(pool.spares):
        missing = ", ".join(item.host for item in bad[len(pool.spares) :])
        return Decision(
            bad,
            {},
            f"no spare left for {missing} ({len(pool.spares)} spare(s) for {len(bad)} bad host(s))",
            cleared,
        )
    if attempt == policy.max_attempts:
        return Decision(bad, {}, "no retries left", cleared)
    return Decision(bad, pool.replace([item.host for item in bad]), None, cleared)


def _judge_hosts(
    policy: Policy,
    hosts: tuple[str, ...],
    attempt: int,
    kind: AttemptClass,
    named: list[Evidence],
    suspected: list[Evidence],
) -> tuple[list[Evidence], list[Evidence]]:
    """Rule 4's table: (the bad hosts, each with why; the suspects whose probe passed)."""
    if named:
        return named, []
    if policy.probe is None:
        return [], []
    probed = tuple(item.host for item in suspected) or hosts
    why = "a peer went away" if suspected else "no host named"
    _say(f"attempt {attempt}: {kind}, {why}; probing {len(probed)} host(s)")
    failed = policy.probe(probed)
    peer_lines = {item.host: item.said for item in suspected}
    bad = [
        Evidence(host, "\n".join(filter(None, (peer_lines.get(host), failed[host].said))), "probe")
        for host in probed
        if host in failed
    ]
    return bad, [item for item in suspected if item.host not in failed]


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


def _tell(
    record: AttemptRecord, duration_s: float, cleared: list[Evidence], furthest: int | None
) -> None:
    """The attempt's line on stderr: what it did, the evidence, and what comes next.
    ``furthest``: the step it did not get past, when it made steps but no progress."""
    for item in record.evidence:
        _say(f"  {item.host}: {item.said.splitlines()[-1]} [{item.source}]")
    for item in cleared:
        _say(f"  {item.host}: {item.said.splitlines()[-1]} [peer; health probe passed: kept]")
    of = f" of {record.of}" if record.of is not None else ""
    beyond = ""
    if record.steps_gained and furthest is not None:
        beyond = f", none past step {furthest}"
    said = (
        f"attempt {record.attempt}{of} exited {record.exit_code} "
        f"({describe_exit(record.exit_code)}) after {duration_s:.1f} s: {record.class_}, "
        f"{record.steps_gained} step(s) gained{beyond}"
    )
    if record.wait_s is None:
        _say(f"{said}; {record.reason}")
        return
    changes = ", ".join(f"{old} -> {new}" for old, new in record.replaced.items())
    hosts = f"replaced {changes}" if changes else "same hosts"
    _say(f"{said}; {hosts}; retrying in {record.wait_s:.1f} s")


def restart_delay(
    num_without_progress: int, backoff_s: float, backoff_max_s: float, rng: random.Random
) -> float:
    """Seconds before the next attempt, after ``num_without_progress`` attempts in a row that
    made no progress (0: the last one did): rule 6 of the module docstring."""
    if num_without_progress == 0:
        ceiling = min(backoff_s, PROGRESS_WAIT_S, backoff_max_s)
    else:
        doublings = min(num_without_progress - 1, MAX_DOUBLINGS)
        ceiling = min(backoff_s * 2.0**doublings, backoff_max_s)
    return ceiling * rng.uniform(0.5, 1.0)


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
