"""Naming the rank that holds a hung attempt up, from every host's forensics report.

``investigate`` runs when the idle watchdog fires, before the ranks are stopped: it collects on
every host (``forensics.collect_host`` in this process for a local launch, else ``python -m
goodput.launch.forensics collect`` on every host at once through one step of the job's own srun
or mpiexec, ``fanout.reach``, within the profile's ``health_timeout_s``; a host silent past it,
or answering garbage, did not answer) and hands the reports to ``name_suspects``. That is a pure
function; the first rule that applies wins:
  1. no answer: a rank stopped, stuck in D, gone, on a host that did not answer, with no beacon
     while its peers have one, or alive without a stack while a peer wrote its own;
  2. out of the collective its peers wait in: ranks outside any collective, at a step no later
     than the lowest waiter's, while others wait;
  3. behind: among the waiting ranks of one ``schedule_id`` (the same sequence of collectives),
     those behind by (step, phase order, collectives entered);
  4. nobody: every rank waits in the same place (the network or the collective library), or
     none waits in a collective (a shared resource such as the file system).
Each suspect is one ``Evidence`` (source ``hang-suspect``; its host as the launcher planned it,
its rank and step; one printable line of at most ``MAX_SAID_CHARS``), e.g. ``hang suspect: rank
1 on nid0012 (pid 4411) not in a collective at step 37, phase data, while 3 rank(s) wait in
step.tokens; stack: faults.py:210 stall <- loop.py:118 train``. The attempt puts them in its
result; ``retry`` records them first in the attempt's evidence. Standard library only.
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from goodput import beacon
from goodput.errors import GoodputError, one_line, printable
from goodput.launch import fanout, forensics, launchers
from goodput.launch.forensics import HostReport, RankReport
from goodput.launch.history import Evidence, EvidenceSource
from goodput.ranks import host_index

MAX_SAID_CHARS = 600
MAX_SUSPECTS = 16
SOURCE: EvidenceSource = "hang-suspect"
CAUSES = {  # a rank that cannot answer, by its process state
    "stopped": "stopped (SIGSTOP)",
    "disk-sleep": "stuck in the kernel (D)",
    "gone": "gone",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Findings:
    """What the forensics concluded: the suspects, and one line saying so."""

    suspects: tuple[Evidence, ...]
    line: str


@dataclass(frozen=True, slots=True)
class _Seen:
    """The ranks the hosts reported (one per rank), and which ranks no answer covers."""

    ranks: dict[int, RankReport]
    silent: dict[str, list[int]]  # host -> its ranks, for hosts that did not answer
    missing: list[int]  # ranks of answering hosts with no beacon


def _merge(reports: Mapping[str, HostReport | None], rank_hosts: Sequence[str]) -> _Seen:
    world = len(rank_hosts)
    ranks: dict[int, RankReport] = {}
    for report in reports.values():
        for item in report.ranks if report is not None else ():
            # A beacon of another world (a stale file) says nothing about this attempt; hosts
            # emulated on one machine all report the same files: the first answer counts.
            if item.world_size == world and item.rank not in ranks:
                ranks[item.rank] = item
    silent: dict[str, list[int]] = {}
    missing = []
    for rank, host in enumerate(rank_hosts):
        if rank in ranks:
            continue
        if reports.get(host) is None:
            silent.setdefault(host, []).append(rank)
        else:
            missing.append(rank)
    return _Seen(ranks, silent, missing)


def name_suspects(reports: Mapping[str, HostReport | None], rank_hosts: Sequence[str]) -> Findings:
    """The module docstring's rules over ``reports`` (host -> its answer, None: no answer);
    ``rank_hosts[r]``: the host rank ``r`` ran on, as the launcher planned it."""
    seen = _merge(reports, rank_hosts)
    if not seen.ranks:
        silent = ", ".join(seen.silent)
        line = f"no rank left a beacon{f' (no answer from {silent})' if silent else ''}"
        return Findings(suspects=(), line=f"{line}: it hung before its first beacon update")
    for rule in (_no_answer, _outside, _behind):
        suspects = rule(seen, rank_hosts)
        if suspects:
            named = [
                f"rank {item.rank} on {item.host}" if item.rank is not None else item.host
                for item in suspects[:MAX_SUSPECTS]
            ]
            more = len(suspects) - len(named)
            line = f"hang suspect(s): {', '.join(named)}" + (f" and {more} more" if more else "")
            return Findings(suspects=tuple(suspects[:MAX_SUSPECTS]), line=line)
    return Findings(suspects=(), line=_nobody(seen))


def _no_answer(seen: _Seen, rank_hosts: Sequence[str]) -> list[Evidence]:
    peers_top = max(item.entered for item in seen.ranks.values())
    suspects = [
        Evidence(host, _said(f"host {host} did not answer (rank(s) {_span(ranks)})"), SOURCE)
        for host, ranks in seen.silent.items()
    ]
    suspects += [
        _evidence(rank_hosts, rank, None, "left no beacon while its peers did")
        for rank in seen.missing
    ]
    someone_answered = any(item.answered for item in seen.ranks.values())
    for item in seen.ranks.values():
        if item.state in CAUSES:
            cause = CAUSES[item.state]
        elif not item.answered and someone_answered:
            cause = "alive but wrote no stack"
        else:
            continue
        where = f"{cause} at step {item.step}, phase {item.phase}"
        counts = f"entered {item.entered} collective(s), peers up to {peers_top}"
        suspects.append(_evidence(rank_hosts, item.rank, item, f"{where}; {counts}"))
    return suspects


def _outside(seen: _Seen, rank_hosts: Sequence[str]) -> list[Evidence]:
    waiters = [item for item in seen.ranks.values() if item.waiting]
    if not waiters:
        return []
    lowest = min(item.step for item in waiters)
    site = _common_site(waiters)
    return [
        _evidence(
            rank_hosts,
            item.rank,
            item,
            f"not in a collective at step {item.step}, phase {item.phase}, "
            f"while {len(waiters)} rank(s) wait in {site}",
        )
        for item in seen.ranks.values()
        if not item.waiting and item.step <= lowest
    ]


def _behind(seen: _Seen, rank_hosts: Sequence[str]) -> list[Evidence]:
    groups: dict[int, list[RankReport]] = collections.defaultdict(list)
    for item in seen.ranks.values():
        if item.waiting:
            groups[item.schedule_id].append(item)
    suspects = []
    for group in groups.values():
        top = max(map(_progress, group))
        for item in group:
            if _progress(item) < top:
                said = (
                    f"behind at step {item.step}, phase {item.phase}: waits in "
                    f"{item.last_site or 'a collective'} after {item.entered} collective(s), "
                    f"peers at step {top[0]}, phase {beacon.PHASES[top[1]]}, {top[2]}"
                )
                suspects.append(_evidence(rank_hosts, item.rank, item, said))
    return sorted(suspects, key=lambda evidence: evidence.rank or 0)


def _progress(item: RankReport) -> tuple[int, int, int]:
    return item.step, beacon.PHASES.index(item.phase), item.entered


def _nobody(seen: _Seen) -> str:
    waiters = [item for item in seen.ranks.values() if item.waiting]
    if not waiters:
        phases = sorted({item.phase for item in seen.ranks.values()})
        step = min(item.step for item in seen.ranks.values())
        return (
            f"no suspect: no rank waits in a collective (step {step}, phase(s) "
            f"{', '.join(phases)}): a shared resource such as the file system"
        )
    step = min(item.step for item in waiters)
    who = "every rank waits"
    if len(waiters) < len(seen.ranks):  # the others are past them (done), holding no one up
        who = f"{len(waiters)} of {len(seen.ranks)} ranks wait, none behind,"
    return (
        f"no suspect: {who} in {_common_site(waiters)} at step {step}: "
        "the network or the collective library"
    )


def _common_site(items: Sequence[RankReport]) -> str:
    counts = collections.Counter(item.last_site or "a collective" for item in items)
    return counts.most_common(1)[0][0]


def _evidence(rank_hosts: Sequence[str], rank: int, item: RankReport | None, what: str) -> Evidence:
    host = rank_hosts[rank]
    pid = f" (pid {item.pid})" if item is not None else ""
    stack = f"; stack: {' <- '.join(item.stack)}" if item is not None and item.stack else ""
    said = _said(f"rank {rank} on {host}{pid} {what}{stack}")
    return Evidence(host, said, SOURCE, rank, item.step if item is not None else None)


def _said(text: str) -> str:
    return printable(one_line(f"hang suspect: {text}", MAX_SAID_CHARS), MAX_SAID_CHARS)


def _span(ranks: Sequence[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def investigate(
    plan: launchers.LaunchPlan,
    directory: Path,
    env: Mapping[str, str],
    notice: Callable[[str], None],
) -> tuple[Evidence, ...]:
    """Collect on every host of ``plan`` (in this process for a local launch), name the
    suspects, say so through ``notice``; the suspects."""
    started = time.monotonic()
    if plan.scheduler == "local":
        reports: dict[str, HostReport | None] = {plan.hosts[0]: forensics.collect_host(directory)}
    else:
        reports = collect_hosts(plan, directory, env)
    rank_hosts = [plan.hosts[host_index(rank, plan.ppn)] for rank in range(plan.nproc)]
    findings = name_suspects(reports, rank_hosts)
    read = sum(len(report.ranks) for report in reports.values() if report is not None)
    notice(
        f"launch: forensics: {read} beacon(s) read on {len(reports)} host(s) in "
        f"{time.monotonic() - started:.1f} s: {findings.line}"
    )
    return findings.suspects


def collect_hosts(
    plan: launchers.LaunchPlan, directory: Path, env: Mapping[str, str]
) -> dict[str, HostReport | None]:
    """Every host's ``collect`` answer, all at once through the job's launcher
    (``fanout.reach``: one step beside the hung one); None for a host that did not answer
    within the profile's ``health_timeout_s``, failed, or answered more than a report or
    garbage."""
    argv = [sys.executable, "-m", "goodput.launch.forensics", "collect", "--dir", str(directory)]
    answers = fanout.reach(
        plan,
        plan.hosts,
        argv,
        env,
        timeout_s=plan.profile.health_timeout_s,
        max_bytes=forensics.MAX_REPORT_BYTES,
        fix="check that the job's launcher runs on the launch node",
        overlap=True,
    )
    reports: dict[str, HostReport | None] = {}
    for host, answer in answers.items():
        try:
            reports[host] = (
                forensics.read_report(answer.output)
                if answer.code == 0 and not answer.cut
                else None
            )
        except GoodputError:
            reports[host] = None
    return reports
