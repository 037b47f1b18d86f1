"""Fuzz the log classifier's evidence scanner (``goodput launch --auto-retry``) and the attempt
classifier behind it.

Property: any bytes a rank prints — random lines, lines built around the real patterns with
hostile host names and addresses, megabyte lines without a newline — never raise, never take
long, and never name a host outside the pool, whatever the address resolver answers. Every
shipped profile's patterns are scanned too.
"""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from goodput.launch.attempt import AttemptResult
from goodput.launch.failover import BAD_NODE_PATTERNS, MAX_STRAGGLERS, EvidenceScanner, classify
from goodput.launch.launchers import load_profile, profile_names
from goodput.stragglers_line import StragglerNotice, parse_notice

PATTERNS = [
    *BAD_NODE_PATTERNS,
    *(pattern for name in profile_names() for pattern in load_profile(name).bad_node_patterns),
]
POOL = ["nid001", "nid002", "x1000c0s0b0n0", "login1.cluster"]
MAX_SECONDS = 2.0

names = st.one_of(
    st.sampled_from([*POOL, "NID001", "nid001.hsn.cm", "nid003", "", "..", "a" * 300]),
    st.text("nid0123.-_xX", max_size=20),
)
# Lines shaped like the evidence the patterns look for, around names and addresses from anywhere.
templates = st.sampled_from(
    [
        "srun: error: {}: task 7: Killed",
        "srun: error: {}: tasks 0-3: Bus error",
        "srun: error: Node failure on {}",
        "=   PID 123 RUNNING AT {}\n=   EXIT CODE: 9",
        "Connection closed by peer [{}]",
        "goodput: error: rank 3 on {}: CUDA error: an illegal memory access",
        "{}: shepherd died from signal 9",
        "Couldn't forward RPC from x to child {}",
        "warning: straggler: rank 3 on {} busy 1.62x the median over steps 12-31 (0.231 s vs "
        "0.143 s)",
        "[rank0]: \x1b[33mwarning: straggler: rank 99999 on {} busy 9.00x the median over steps "
        "1-2 (0.900 s vs 0.100 s)\x1b[0m",
    ]
)
lines = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    st.tuples(templates, names).map(lambda pair: pair[0].format(pair[1]).encode()),
    st.tuples(templates, names, st.integers(1, 1 << 20)).map(  # one long line, no newline
        lambda t: (t[0].format(t[1]).replace("\n", " ") * (t[2] // 40 + 1)).encode()
    ),
)


@given(st.lists(lines, max_size=8), st.lists(names, max_size=3))
def test_evidence_names_only_hosts_of_the_pool(output, resolved):
    scanner = EvidenceScanner(PATTERNS, POOL, resolve=lambda _address: resolved)
    began = time.monotonic()
    for chunk in output:
        for line in chunk.split(b"\n"):
            scanner(line)
    assert time.monotonic() - began < MAX_SECONDS
    assert set(scanner.found) <= set(POOL)
    for host, evidence in scanner.found.items():
        assert evidence.host == host and evidence.source == "log"
    assert len(scanner.stragglers) <= MAX_STRAGGLERS
    for (rank, _), evidence in scanner.stragglers.items():
        assert evidence.host in POOL and evidence.source == "straggler" and evidence.rank == rank
        assert parse_notice(evidence.said) is not None and evidence.step is not None


@given(st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(POOL)), max_size=200))
def test_straggler_warnings_are_kept_first_per_rank_and_bounded(warned):
    """Without host or peer patterns (plain retries) the scanner still reads every warning."""
    scanner = EvidenceScanner([], POOL)
    for rank, host in warned:
        scanner(_warning(rank, host).line().encode())
    first: dict[int, str] = {}
    for rank, host in warned:
        first.setdefault(rank, host)
    kept = list(first.items())[:MAX_STRAGGLERS]
    assert [(rank, item.host) for (rank, _), item in scanner.stragglers.items()] == kept
    assert scanner.found == scanner.suspected == {}


def _warning(rank: int, host: str) -> StragglerNotice:
    return StragglerNotice(
        rank=rank, host=host, ratio=1.5, first_step=3, last_step=9, busy_s=0.3, median_s=0.2
    )


@given(
    st.integers(-(2**31), 2**31),
    st.booleans(),
    st.one_of(st.none(), st.integers(0, 2**40)),
    st.one_of(st.none(), st.sampled_from([2, 15, 9])),
    st.integers(0, 100),
)
def test_every_attempt_gets_a_class(exit_code, timed_out, last_step, launcher_signal, gained):
    result = AttemptResult(
        exit_code, 1.0, timed_out, None, 0, last_step, last_step, [], launcher_signal
    )
    assert classify(result, gained, []) in {
        "success", "interrupted", "walltime", "hang", "stuck-pre-training", "straggler", "error",
    }  # fmt: skip
