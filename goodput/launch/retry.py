"""The attempt loop: run an attempt, classify it, decide, log it, wait, run the next.

One loop serves ``--retries R`` and ``--auto-retry``; a ``Policy`` says what differs. After every
attempt, in this order:
  1. it gets its class and progress (``failover.classify``, ``failover.progress``); an attempt
     in which the trainer's last heartbeat said the run is complete (``done``) is a success
     whatever its exit (a teardown that hung past the watchdog), and the launch exits 0;
  2. it stops on ``success``, ``walltime`` (the allocation is ending: continuing is the job
     chain's work, in a new allocation) and ``interrupted``, on a usage error (exit 2),
     which the next attempt would repeat, and on the eval gate's stop (exit 3: the run is not
     learning; a retry resumes into the same state);
  3. it stops after ``max_stepless`` attempts in a row without a step, if the policy sets it (a
     config bug must not burn the spare pool);
  4. it judges the hosts (``failover`` says what host and peer evidence are), by the first row
     that applies:
       host evidence names H             H is bad (source ``log``), without a probe: the line
                                         says enough, and explains the peers' lines too
       no probe (plain retries)          no host is bad
       class ``straggler`` (exit 4)      the host of each straggler warning is bad (source
                                         ``straggler``), without a probe (it is slow, not
                                         broken), as far as spares go; the rest are kept
       a hang with suspects on S         S is probed first: failed, bad (source ``probe``, the
                                         suspect's line kept with the answer). All passed: a
                                         host of S that was a suspect of the previous attempt,
                                         a hang too, is bad (source ``hang-suspect``) while a
                                         spare is left ("named the hang suspect twice in a
                                         row; probe passed: replaced", else "...; no spare:
                                         kept"); none such: the other hosts are probed, the
                                         failed are bad
       only peer evidence names H        H is probed: failed, H is bad (source ``probe``, the
                                         peer line kept with the answer); passed, H is kept,
                                         and the attempt's stderr line says so
       no evidence                       every active host is probed; the failed are bad
     An attempt whose processes go on to an in-process recovery (``continues``, under
     ``goodput launch --in-process``) is judged by host evidence alone: no probe holds the
     survivors up, and they stay on their hosts. It stops when a bad host has no spare left.
     Peer evidence and suspects alone never make a host bad, so they never stop a run for want
     of a spare: a single-host run (local ranks, one node) whose rank died or hung retries on
     the same host;
  5. it stops once ``max_attempts`` attempts have run;
  6. otherwise the bad hosts are swapped for spares, in place, and the next attempt starts
     after a wait. Backoff protects the scheduler and the file systems from crash loops; it
     must not punish progress. An attempt made progress when it reached a step that no
     earlier attempt of this launch reached (by its ``step=`` lines or the heartbeat):
       - after progress, or a straggler's eviction (a planned stop after a save, whatever
         step it reached): at most ``PROGRESS_WAIT_S`` (1 s, ``backoff_s`` if smaller), jittered;
       - after k attempts in a row without progress — no step at all, or the same crash at the
         same step again: ``backoff_s * 2**(k-1)``, capped at ``backoff_max_s``;
       - before an in-process recovery of the attempt's own processes: none (``wait_s`` 0);
     each times a jitter factor in [0.5, 1], so that the ranks of many jobs restarting at once
     do not stampede a file system or a scheduler.
Plain ``--retries R`` is ``Policy(max_attempts=R + 1)``: no patterns, no probe, no step-less
limit, so it never blames a host and retries on the same ones, with the same waits. Every
attempt appends one ``history.AttemptRecord`` to the attempts log and prints one line, before
the wait. In every mode the record's evidence holds, in this order, the attempt's hang suspects
(``AttemptResult.suspects``), the straggler warnings its output held, then why each bad host
is bad; only ``replaced`` blames a host.
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
from goodput.launch.history import (
    AttemptClass,
    AttemptRecord,
    Evidence,
    Recovery,
    append_record,
    timestamp,
)
from goodput.launch.inprocess import Fallback, Recovered

EXIT_MEANINGS: dict[int, str] = {
    ExitCode.OK: "ok",
    ExitCode.ERROR: "error",
    ExitCode.USAGE: "usage or config error",
    ExitCode.NOT_LEARNING: "stopped by the eval gate",
    ExitCode.STRAGGLER: "stopped after a save to replace a straggler's host",
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
class Findings:
    """What an attempt's output and forensics said about its hosts, each list in host order."""

    named: list[Evidence]  # host evidence against active hosts
    suspected: list[Evidence]  # peer evidence against active hosts no host evidence names
    suspects: list[Evidence]  # the hang's suspects on active hosts (AttemptResult.suspects)
    stragglers: list[Evidence]  # straggler warnings about ranks on active hosts
    suspects_before: frozenset[str]  # hosts of the previous attempt's suspects, if it hung


@dataclass(frozen=True, slots=True)
class Decision:
    evidence: list[Evidence]  # why each bad host is bad
    replaced: dict[str, str]
    stop: str | None  # why the loop stops; None: it retries
    notes: list[str] = dataclasses.field(default_factory=list)  # hosts judged and kept, and why


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
    suspects_before: frozenset[str] = frozenset()  # the last attempt's suspects, if it hung
    for attempt in itertools.count(1):
        hosts = tuple(pool.active)
        # Always on: without host or peer patterns (plain retries) it reads only the
        # straggler warnings, which every mode records.
        scanner = failover.EvidenceScanner(
            policy.patterns, [*pool.active, *pool.spares], resolve, policy.peer_patterns
        )
        before = failover.read_heartbeat(heartbeat)
        started, clock = datetime.now(UTC), time.monotonic()
        result = start_attempt(hosts, scanner)
        ended = started + timedelta(seconds=time.monotonic() - clock)
        after = failover.read_heartbeat(heartbeat)
        reached = failover.progress(result, before, after)
        progressed = reached.last_step is not None and (
            furthest is None or reached.last_step > furthest
        )
        furthest = reached.last_step if progressed else furthest
        stepless = 0 if reached.steps_gained else stepless + 1
        findings = _findings(scanner, result, hosts, suspects_before)
        finished = failover.finished(before, after)
        kind = failover.classify(result, reached.steps_gained, findings.named, finished=finished)
        without_progress = 0 if progressed or kind == "straggler" else without_progress + 1
        suspects_before = frozenset(item.host for item in findings.suspects if kind == "hang")
        # Processes recovered in process stay on their hosts: only host evidence judges them.
        probe = None if result.continues else policy.probe
        decision = _decide(
            dataclasses.replace(policy, probe=probe),
            pool,
            attempt,
            kind,
            result.exit_code,
            stepless,
            findings,
        )
        if kind in ("error", "stuck-pre-training") and decision.evidence:
            kind = "bad-node"  # a crash whose suspect then failed its health probe
        wait_s = None
        if decision.stop is None and result.continues:
            wait_s = 0.0  # the next attempt recovers these processes in process: no wait
        elif decision.stop is None:  # rounded as logged, so the log says what was slept
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
            evidence=_recorded(findings, decision),
            decision=decision,
            wait_s=wait_s,
        )
        append_record(attempts_log, record)
        _tell(record, result.duration_s, decision.notes, None if progressed else furthest)
        if finished and result.exit_code != ExitCode.OK:
            _say(
                f"the run is complete (its last heartbeat says done), but its processes ended "
                f"with exit {result.exit_code}: not retried"
            )
            return ExitCode.OK
        if wait_s is None:
            return result.exit_code
        if result.continues:
            continue
        try:
            sleep(wait_s)
        except KeyboardInterrupt:
            _say("interrupted while waiting to retry")
            return ExitCode.INTERRUPTED
    raise AssertionError("unreachable: the loop ends by returning")


def _findings(
    scanner: failover.EvidenceScanner,
    result: AttemptResult,
    hosts: tuple[str, ...],
    suspects_before: frozenset[str],
) -> Findings:
    found, suspected = scanner.found, scanner.suspected
    return Findings(
        named=[found[host] for host in hosts if host in found],
        suspected=[suspected[h] for h in hosts if h in suspected and h not in found],
        suspects=failover.on_hosts(result.suspects, hosts),
        stragglers=[item for item in scanner.stragglers.values() if item.host in hosts],
        suspects_before=suspects_before,
    )


def _recorded(findings: Findings, decision: Decision) -> tuple[Evidence, ...]:
    """The record's evidence: suspects first (the report shows the first), then straggler
    warnings, then why each bad host is bad; an item judged bad as it was named is kept once."""
    return tuple(dict.fromkeys([*findings.suspects, *findings.stragglers, *decision.evidence]))


def _decide(
    policy: Policy,
    pool: failover.Pool,
    attempt: int,
    kind: AttemptClass,
    exit_code: int,
    stepless: int,
    findings: Findings,
) -> Decision:
    """Rules 2-6 of the module docstring; swaps hosts in ``pool`` when it retries."""
    named = findings.named
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
    bad, notes = _judge_hosts(policy, pool, attempt, kind, findings)
    if len(bad) > len(pool.spares):
        missing = ", ".join(item.host for item in bad[len(pool.spares) :])
        return Decision(
            bad,
            {},
            f"no spare left for {missing} ({len(pool.spares)} spare(s) for {len(bad)} bad host(s))",
            notes,
        )
    if attempt == policy.max_attempts:
        return Decision(bad, {}, "no retries left", notes)
    return Decision(bad, pool.replace([item.host for item in bad]), None, notes)


def _judge_hosts(
    policy: Policy, pool: failover.Pool, attempt: int, kind: AttemptClass, findings: Findings
) -> tuple[list[Evidence], list[str]]:
    """Rule 4's table: (the bad hosts, each with why; the judged hosts kept, and why)."""
    if findings.named:
        return findings.named, []
    if policy.probe is None:
        return [], []
    if kind == "straggler":
        return _evict_stragglers(findings.stragglers, len(pool.spares))
    hosts = tuple(pool.active)
    if kind == "hang" and findings.suspects:
        return _judge_suspects(policy.probe, hosts, len(pool.spares), attempt, findings)
    if findings.suspected:
        why = f"{kind}, a peer went away"
        return _probe(policy.probe, attempt, why, _first_per_host(findings.suspected))
    _say(f"attempt {attempt}: {kind}, no host named; probing {len(hosts)} host(s)")
    failed = policy.probe(hosts)
    return [failed[host] for host in hosts if host in failed], []


def _probe(
    probe: Probe, attempt: int, why: str, named: list[Evidence]
) -> tuple[list[Evidence], list[str]]:
    """Probe the hosts of ``named`` (one peer line or hang suspect per host): the failed are
    bad, with what named them kept above the probe's answer; the passed are kept, and a note
    says so (with the peer line; a suspect's is in the record, printed above)."""
    _say(f"attempt {attempt}: {why}; probing {len(named)} host(s)")
    failed = probe(tuple(item.host for item in named))
    bad = [
        Evidence(item.host, f"{item.said}\n{failed[item.host].said}", "probe", item.rank, item.step)
        for item in named
        if item.host in failed
    ]
    kept = [
        f"{item.host}: [hang suspect; health probe passed: kept]"
        if item.source == "hang-suspect"
        else f"{item.host}: {item.said.splitlines()[-1]} [peer; health probe passed: kept]"
        for item in named
        if item.host not in failed
    ]
    return bad, kept


def _judge_suspects(
    probe: Probe, hosts: tuple[str, ...], spares: int, attempt: int, findings: Findings
) -> tuple[list[Evidence], list[str]]:
    """A hang with suspects: their hosts are probed first; if every probe passes, a host named
    twice in a row is bad while a spare is left; else the other hosts are probed."""
    suspects = _first_per_host(findings.suspects)
    bad, kept = _probe(probe, attempt, "hang, suspects named", suspects)
    if bad:
        return bad, kept
    twice = [item for item in suspects if item.host in findings.suspects_before]
    said = "named the hang suspect twice in a row; probe passed"
    kept += [f"{item.host}: {said}: replaced" for item in twice[:spares]]
    kept += [f"{item.host}: {said}; no spare: kept" for item in twice[spares:]]
    if twice[:spares]:
        return twice[:spares], kept
    others = tuple(host for host in hosts if host not in {item.host for item in suspects})
    if not others:
        return [], kept
    _say(f"attempt {attempt}: hang, the suspects' probes passed; probing {len(others)} other(s)")
    failed = probe(others)
    return [failed[host] for host in others if host in failed], kept


def _evict_stragglers(stragglers: list[Evidence], spares: int) -> tuple[list[Evidence], list[str]]:
    """Class ``straggler``: the host of each straggler warning is bad, as far as spares go."""
    evicted = _first_per_host(stragglers)
    if not evicted:
        return [], ["exit 4 (straggler), but no straggler warning named a host: same hosts"]
    kept = [f"{item.host}: straggler; no spare: kept" for item in evicted[spares:]]
    return evicted[:spares], kept


def _first_per_host(items: list[Evidence]) -> list[Evidence]:
    """Each host's first item, in order."""
    first: dict[str, Evidence] = {}
    for item in items:
        first.setdefault(item.host, item)
    return list(first.values())


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
    evidence: tuple[Evidence, ...],
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
        evidence=evidence,
        replaced=decision.replaced,
        spares_left=spares_left,
        decision="stop" if decision.stop is not None else "retry",
        reason=decision.stop,
        wait_s=wait_s,
        recovery=_recovery_record(result.recovery),
    )


def _recovery_record(recovery: Recovered | Fallback | None) -> Recovery | None:
    """The record of how an attempt began in process (``AttemptResult.recovery``)."""
    if isinstance(recovery, Fallback):
        return Recovery(rank=recovery.rank, fallback=recovery.why)
    if recovery is None:
        return None
    return Recovery(
        rank=recovery.rank,
        spare=recovery.spare,
        generation=recovery.generation,
        abort_s=round(recovery.abort_s, 3),
        rendezvous_s=round(recovery.rendezvous_s, 3),
    )


def _first_step_at(result: AttemptResult, ended: datetime) -> str | None:
    """The attempt's processes ran for the last ``duration_s`` before ``ended``."""
    if result.first_step_after_s is None:
        return None
    return timestamp(ended - timedelta(seconds=result.duration_s - result.first_step_after_s))


def _tell(record: AttemptRecord, duration_s: float, notes: list[str], furthest: int | None) -> None:
    """The attempt's line on stderr: what it did, the evidence, the hosts judged and kept, and
    what comes next. ``furthest``: the step it did not get past, when it made steps but no
    progress."""
    for item in record.evidence:
        _say(f"  {item.host}: {item.said.splitlines()[-1]} [{item.source}]")
    for note in notes:
        _say(f"  {note}")
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
