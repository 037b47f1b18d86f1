"""The attempt loop's judgement of hosts after a hang with suspects and after a straggler's
eviction, and the evidence it records in every mode.

The attempts are fakes (no process runs): what an attempt returns — its exit, its output lines,
the suspects forensics named — is this test's input, and the loop's records, probes and spare
swaps are its output. Real processes run these paths in test_retry_eviction.py and, under Slurm,
test_slurm.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from goodput.errors import ExitCode
from goodput.launch.attempt import AttemptResult
from goodput.launch.failover import BAD_NODE_PATTERNS, PEER_PATTERNS, Pool
from goodput.launch.history import AttemptRecord, Evidence, read_attempts
from goodput.launch.retry import PROGRESS_WAIT_S, Policy, run_attempts
from goodput.stragglers_line import StragglerNotice


def suspect(host: str, rank: int, step: int) -> Evidence:
    """A suspect as forensics names it (``AttemptResult.suspects``)."""
    said = (
        f"hang suspect: rank {rank} on {host} (pid 4411) not in a collective at step {step}, "
        "phase data, while 1 rank(s) wait in step.tokens; stack: faults.py:210 stall"
    )
    return Evidence(host, said, "hang-suspect", rank, step)


def warning(rank: int, host: str, last_step: int) -> str:
    """The straggler line as the trainer prints it."""
    notice = StragglerNotice(
        rank=rank, host=host, ratio=1.62, first_step=1, last_step=last_step, busy_s=0.231,
        median_s=0.143,
    )  # fmt: skip
    return notice.line()


@dataclass(frozen=True)
class Attempt:
    """What one fake attempt does: its exit, the steps it prints, its lines and suspects."""

    code: int
    steps: tuple[int, int] | None = (1, 5)
    timed_out: bool = False
    lines: tuple[str, ...] = ()
    suspects: tuple[Evidence, ...] = ()


@dataclass
class Loop:
    """A run of the loop over fake attempts: what it started, probed, slept and recorded."""

    started: list[tuple[str, ...]] = field(default_factory=list)
    probed: list[tuple[str, ...]] = field(default_factory=list)
    slept: list[float] = field(default_factory=list)
    records: list[AttemptRecord] = field(default_factory=list)
    code: int | None = None


def run_loop(
    tmp_path: Path,
    attempts: list[Attempt],
    pool: Pool,
    *,
    sick: frozenset[str] = frozenset(),
    auto_retry: bool = True,
    backoff_s: float = 0.0,
) -> Loop:
    """The loop under ``--auto-retry``'s policy (else plain ``--retries``) with a probe that
    fails on the ``sick`` hosts."""
    loop = Loop()
    script = iter(attempts)

    def start_attempt(hosts: tuple[str, ...], on_line: Callable[[bytes], None] | None):
        attempt = next(script)
        loop.started.append(hosts)
        assert on_line is not None  # every mode reads the straggler warnings
        for line in attempt.lines:
            on_line(line.encode())
        first, last = attempt.steps or (None, None)
        seen = 0 if attempt.steps is None else last - first + 1
        # It lasts no time: a real one lies within the loop's own clock.
        return AttemptResult(
            attempt.code, 0.0, attempt.timed_out, None, seen, last, first, [], None,
            None if attempt.steps is None else 0.0, suspects=attempt.suspects,
        )  # fmt: skip

    def probe(hosts: tuple[str, ...]) -> dict[str, Evidence]:
        loop.probed.append(hosts)
        return {
            h: Evidence(h, "health probe exit 1: GPU 3 missing", "probe")
            for h in hosts
            if h in sick
        }

    policy = Policy(max_attempts=len(attempts), backoff_s=backoff_s)
    if auto_retry:
        policy = Policy(
            max_attempts=len(attempts), backoff_s=backoff_s, patterns=BAD_NODE_PATTERNS,
            peer_patterns=PEER_PATTERNS, probe=probe, max_stepless=2,
        )  # fmt: skip
    log = tmp_path / "attempts.jsonl"
    loop.code = run_attempts(
        start_attempt, policy, pool, attempts_log=log, sleep=loop.slept.append,
        resolve=lambda address: [],
    )  # fmt: skip
    loop.records = read_attempts(log)  # strictly, as a report reads them
    return loop


HANG = ExitCode.IDLE_TIMEOUT


def test_a_host_named_the_hang_suspect_twice_in_a_row_is_replaced(tmp_path, capsys):
    first, second = suspect("n2", 1, 5), suspect("n2", 1, 9)
    loop = run_loop(
        tmp_path,
        [
            Attempt(HANG, (1, 5), timed_out=True, suspects=(first,)),
            Attempt(HANG, (6, 9), timed_out=True, suspects=(second,)),
            Attempt(0, (10, 12)),
        ],
        Pool(["n1", "n2"], ["n3"]),
    )
    assert loop.code == 0
    assert loop.started == [("n1", "n2"), ("n1", "n2"), ("n1", "n3")]
    # Suspect first; once its probe passed, the other host: a hang's cause may lie elsewhere.
    assert loop.probed == [("n2",), ("n1",), ("n2",)]
    one, two, three = loop.records
    assert (one.class_, one.evidence, one.replaced) == ("hang", (first,), {})
    # The suspect itself is why n2 is bad: recorded once, first, and named by ``replaced``.
    assert (two.class_, two.evidence, two.replaced) == ("hang", (second,), {"n2": "n3"})
    assert three.class_ == "success" and three.evidence == ()
    err = capsys.readouterr().err
    assert "n2: named the hang suspect twice in a row; probe passed: replaced" in err
    assert "[hang suspect; health probe passed: kept]" in err


def test_without_a_spare_the_twice_named_suspect_is_kept_and_the_run_goes_on(tmp_path, capsys):
    loop = run_loop(
        tmp_path,
        [
            Attempt(HANG, (1, 5), timed_out=True, suspects=(suspect("n2", 1, 5),)),
            Attempt(HANG, (6, 9), timed_out=True, suspects=(suspect("n2", 1, 9),)),
            Attempt(0, (10, 12)),
        ],
        Pool(["n1", "n2"], []),
    )
    assert loop.code == 0 and loop.started == [("n1", "n2")] * 3
    assert [r.replaced for r in loop.records] == [{}, {}, {}]
    assert [r.decision for r in loop.records] == ["retry", "retry", "stop"]
    assert "n2: named the hang suspect twice in a row; probe passed; no spare: kept" in (
        capsys.readouterr().err
    )


def test_the_suspects_host_is_probed_first_and_a_failed_probe_replaces_it(tmp_path):
    named = suspect("n2", 1, 5)
    loop = run_loop(
        tmp_path,
        [Attempt(HANG, timed_out=True, suspects=(named,)), Attempt(0, (6, 8))],
        Pool(["n1", "n2"], ["n3"]),
        sick=frozenset({"n2"}),
    )
    assert loop.probed == [("n2",)]  # the suspect's failed probe says enough: n1 is not probed
    (hang, _) = loop.records
    assert hang.class_ == "hang"  # a suspect never makes an attempt bad-node, even when blamed
    bad = Evidence("n2", f"{named.said}\nhealth probe exit 1: GPU 3 missing", "probe", 1, 5)
    assert hang.evidence == (named, bad) and hang.replaced == {"n2": "n3"}


@pytest.mark.parametrize(
    ("before", "what"),
    [
        (Attempt(HANG, (1, 5), timed_out=True, suspects=(suspect("n1", 0, 5),)), "another host"),
        (Attempt(1, (1, 5), suspects=(suspect("n2", 1, 5),)), "not a hang"),
        (Attempt(HANG, (1, 5), timed_out=True), "no suspect"),
    ],
)
def test_a_suspect_is_replaced_only_after_a_hang_that_named_the_same_host(tmp_path, before, what):
    loop = run_loop(
        tmp_path,
        [before, Attempt(HANG, (6, 9), timed_out=True, suspects=(suspect("n2", 1, 9),))],
        Pool(["n1", "n2"], ["n3"]),
    )
    assert loop.records[-1].replaced == {}, what
    assert loop.probed[-2:] == [("n2",), ("n1",)], what


def test_a_stragglers_host_is_replaced_at_once_after_its_eviction_stop(tmp_path, capsys):
    line = warning(1, "n2", 24)
    loop = run_loop(
        tmp_path,
        [
            Attempt(1, (1, 30)),  # a crash at step 30, after the save of step 20
            # Resumed from step 20, it stops after saving step 25, short of step 30.
            Attempt(ExitCode.STRAGGLER, (21, 25), lines=("step=24", f"[rank0]: {line}")),
            Attempt(0, (26, 40)),
        ],
        Pool(["n1", "n2"], ["n3"]),
        backoff_s=100.0,
    )
    _, evicted, done = loop.records
    assert evicted.class_ == "straggler" and evicted.exit_code == 4
    assert evicted.evidence == (Evidence("n2", line, "straggler", 1, 24),)
    assert evicted.replaced == {"n2": "n3"} and loop.started[2] == ("n1", "n3")
    assert loop.probed == [("n1", "n2")]  # the crash's; a slow host would pass a probe
    assert done.class_ == "success"
    # It reached no new step (25 < 30), where a crash would wait 50-100 s; a planned stop
    # after a save waits as after progress.
    assert 0 < loop.slept[1] <= PROGRESS_WAIT_S
    assert "replaced n2 -> n3" in capsys.readouterr().err


def test_an_eviction_stop_without_a_warning_retries_on_the_same_hosts(tmp_path, capsys):
    loop = run_loop(
        tmp_path,
        [Attempt(ExitCode.STRAGGLER, (1, 24)), Attempt(0, (21, 30))],
        Pool(["n1", "n2"], ["n3"]),
    )
    assert loop.records[0].class_ == "straggler" and loop.records[0].replaced == {}
    assert loop.started == [("n1", "n2")] * 2
    assert "no straggler warning named a host: same hosts" in capsys.readouterr().err


def test_plain_retries_record_suspects_first_then_warnings_and_blame_no_host(tmp_path):
    named = suspect("n2", 1, 7)
    lines = (
        warning(0, "n1.hsn.cm", 6),  # its first label names the pool host
        warning(0, "n1", 9),  # the first warning about a rank is kept
        warning(1, "elsewhere", 9),  # not a host of this launch
        "warning: straggler: rank 1 on n2 busy 1.62x the median",  # cut short
        warning(1, "n2", 9) + " and more",  # text after the line
        "\x1b[31m" + warning(1, "n2", 8) + "\x1b[0m",  # colours are not part of it
    )
    loop = run_loop(
        tmp_path,
        [Attempt(HANG, (1, 9), timed_out=True, lines=lines, suspects=(named,)), Attempt(0)],
        Pool(["n1", "n2"], ["n3"]),
        auto_retry=False,
    )
    hang = loop.records[0]
    assert hang.evidence == (
        named,
        Evidence("n1", warning(0, "n1.hsn.cm", 6), "straggler", 0, 6),
        Evidence("n2", warning(1, "n2", 8), "straggler", 1, 8),
    )
    assert hang.replaced == {} and loop.probed == [] and loop.started[1] == ("n1", "n2")


def test_a_suspect_on_a_host_outside_the_attempt_is_left_out(tmp_path):
    kept = suspect("n1.hsn.cm", 0, 3)  # a rank names its host by its first label too
    loop = run_loop(
        tmp_path,
        [Attempt(HANG, timed_out=True, suspects=(suspect("nid99", 5, 3), kept)), Attempt(0)],
        Pool(["n1", "n2"], ["n3"]),
        auto_retry=False,
    )
    (item,) = loop.records[0].evidence
    assert (item.host, item.rank, item.said) == ("n1", 0, kept.said)
