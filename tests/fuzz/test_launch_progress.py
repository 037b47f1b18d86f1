"""Fuzz what the launcher's progress and peer evidence are read from: the heartbeat file (any
bytes, any JSON), the ``GOODPUT_HEARTBEAT`` variable the trainer reads, and the output lines the
peer patterns scan.

Properties: a heartbeat is a step in [0, 2**53] and a finite time, or nothing, and the progress
worked out from it is never negative; the variable gives the trainer's heartbeat files or a
one-line error; peer evidence names only hosts of the pool, quickly, whatever the resolver says.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput import rundir
from goodput.launch.attempt import AttemptResult
from goodput.launch.failover import (
    PEER_PATTERNS,
    EvidenceScanner,
    finished,
    progress,
    read_heartbeat,
)
from goodput.ranks import HEARTBEAT_VAR
from goodput.testing.fuzz import json_values, result_or_refusal

POOL = ["nid001", "nid002", "localhost"]

contents = st.one_of(
    st.binary(max_size=300),
    json_values().map(lambda value: json.dumps(value).encode()),
    st.fixed_dictionaries(
        {"step": json_values(2**53, 2**53 + 1, -1), "time": json_values(1e308, float("nan"))},
        optional={"done": json_values(True, False)},  # the run's last beat
    ).map(lambda value: json.dumps(value).encode()),
)


@given(contents, contents, st.one_of(st.none(), st.integers(0, 10**6)))
def test_any_heartbeat_reads_as_a_step_or_nothing(first, second, last_step):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "heartbeat"
        path.write_bytes(first)
        before = read_heartbeat(path)
        path.write_bytes(second)
        after = read_heartbeat(path)
    for beat in (before, after):
        assert beat is None or (0 <= beat.step <= 2**53 and abs(beat.time) < float("inf"))
        assert beat is None or type(beat.done) is bool
    assert not finished(before, after) or (after is not None and after.done)
    steps = (1, last_step) if last_step is not None else (0, None)
    result = AttemptResult(1, 1.0, False, None, steps[0], last_step, last_step, [])
    reached = progress(result, before, after)
    assert reached.steps_gained >= 0
    assert reached.last_step is None or reached.last_step >= 0


paths = st.lists(st.text(min_size=1, max_size=300), max_size=4).map(
    lambda parts: "/" + "/".join([*parts, rundir.HEARTBEAT])
)


@given(st.one_of(st.text(max_size=300), paths, st.just("/" + "a" * 5000 + "/heartbeat")))
def test_the_heartbeat_variable_gives_files_or_one_line(value):
    with tempfile.TemporaryDirectory() as folder:
        files = result_or_refusal(rundir.heartbeat_files, folder, {HEARTBEAT_VAR: value})
    assert files is None or files[0] == Path(folder) / rundir.HEARTBEAT
    assert files is None or all(path.name == rundir.HEARTBEAT for path in files)


names = st.one_of(
    st.sampled_from([*POOL, "NID001", "nid001.hsn.cm", "nid003", "", "127.0.0.1", "::1"]),
    st.text("nid0123.:-_xX", max_size=20),
)
templates = st.sampled_from(
    [
        "Connection closed by peer [{}]:29500",
        "Read error [{}]:6021: Connection reset by peer",
        "NCCL WARN socketProgress: Connection closed by remote peer {}<46353>",
        "srun: error: {}: tasks 0-3: Exited with exit code 1",
        "=   PID 1 RUNNING AT {}\n=   EXIT CODE: 11",
    ]
)
lines = st.one_of(
    st.binary(max_size=200),
    st.tuples(templates, names).map(lambda pair: pair[0].format(pair[1]).encode()),
    st.tuples(templates, names, st.integers(1, 1 << 20)).map(  # one long line, no newline
        lambda t: (t[0].format(t[1]).replace("\n", " ") * (t[2] // 40 + 1)).encode()
    ),
)


@given(st.lists(lines, max_size=8), st.lists(names, max_size=3))
def test_peer_evidence_names_only_hosts_of_the_pool(output, resolved):
    scanner = EvidenceScanner(
        [], POOL, resolve=lambda _address: resolved, peer_patterns=PEER_PATTERNS
    )
    began = time.monotonic()
    for chunk in output:
        for line in chunk.split(b"\n"):
            scanner(line)
    assert time.monotonic() - began < 2.0
    assert scanner.found == {} and set(scanner.suspected) <= set(POOL)
    for host, evidence in scanner.suspected.items():
        assert evidence.host == host and evidence.source == "log" and "\0" not in evidence.said
