"""Fuzz the attempts log (``RUN/attempts.jsonl``): its strict reader and the loop that writes it.

Properties: any file read as an attempts log gives records or one ``GoodputError`` naming the
file (and, for a bad line, its number), never another exception; a valid record with any key
set to any JSON value is read or refused the same way; and whatever the attempt loop writes —
any exit codes, steps, signals, evidence lines with hostile bytes, probe answers, plain or
``--auto-retry`` policy — reads back, one record per attempt.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import signal
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.launch.attempt import AttemptResult
from goodput.launch.failover import BAD_NODE_PATTERNS, Pool
from goodput.launch.history import (
    AttemptRecord,
    Evidence,
    Recovery,
    parse_record,
    read_attempts,
)
from goodput.launch.retry import Policy, run_attempts
from goodput.testing.fuzz import json_values, result_or_refusal

HOSTS = ["n1", "n2", "n3", "n4"]
KEYS = [("class" if f.name == "class_" else f.name) for f in dataclasses.fields(AttemptRecord)]
VALID = json.dumps(
    {
        "attempt": 1,
        "of": 2,
        "job": "7",
        "class": "hang",
        "exit_code": 124,
        "timed_out": True,
        "first_failure_label": None,
        "started": "2025-01-01T00:00:00.000+00:00",
        "first_step_at": "2025-01-01T00:00:01.000+00:00",
        "ended": "2025-01-01T00:00:09.000+00:00",
        "steps_seen": 2,
        "first_step": 1,
        "last_step": 2,
        "steps_gained": 2,
        "hosts": ["n1"],
        "evidence": [
            {
                "host": "n1",
                "said": "hang suspect: rank 0 on n1",
                "source": "hang-suspect",
                "rank": 0,
                "step": 2,
            },
            {"host": "n1", "said": "health probe exit 1: sick", "source": "probe"},
        ],
        "replaced": {"n1": "n2"},
        "spares_left": [],
        "decision": "retry",
        "reason": None,
        "wait_s": 1.5,
        "recovery": {
            "rank": 0,
            "spare": 0,
            "generation": 1,
            "abort_s": 0.21,
            "rendezvous_s": 0.02,
            "fallback": None,
        },
    }
)


def _as_lines(values: list) -> bytes:
    return b"".join(json.dumps(value).encode() + b"\n" for value in values)


@given(st.one_of(st.binary(max_size=2000), st.lists(json_values()).map(_as_lines)))
def test_any_file_reads_as_records_or_one_line_naming_it(data):
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "attempts.jsonl"
        log.write_bytes(data)
        try:
            read_attempts(log)
        except GoodputError as error:
            assert "\n" not in error.render() and error.where.startswith(str(log))


@given(st.sampled_from(KEYS), json_values())
def test_a_record_with_any_value_anywhere_is_read_or_refused(key, value):
    line = json.dumps({**json.loads(VALID), key: value})
    result = result_or_refusal(parse_record, line, "attempts.jsonl:7")
    assert result is None or isinstance(result, AttemptRecord)


EVIDENCE_KEYS = [field.name for field in dataclasses.fields(Evidence)]


@given(st.sampled_from(EVIDENCE_KEYS), st.one_of(json_values(), st.just("DROP")))
def test_an_evidence_item_with_any_value_or_a_key_dropped_is_read_or_refused(key, value):
    """``rank`` and ``step`` may be left out (older lines); any other change is read or refused
    with the line's own name, never another exception."""
    record = json.loads(VALID)
    item = {**record["evidence"][0], key: value}
    record["evidence"][0] = {k: v for k, v in item.items() if v != "DROP"}
    result = result_or_refusal(parse_record, json.dumps(record), "attempts.jsonl:7")
    if value == "DROP" and key in ("rank", "step"):
        assert result is not None and getattr(result.evidence[0], key) is None


RECOVERY_KEYS = [field.name for field in dataclasses.fields(Recovery)]


@given(st.sampled_from(RECOVERY_KEYS), st.one_of(json_values(), st.just("DROP")))
def test_a_recovery_with_any_value_or_a_key_dropped_is_read_or_refused(key, value):
    """An in-process recovery's parts: read (all timed, or a fallback alone) or refused with
    the line's own name, never another exception."""
    record = json.loads(VALID)
    item = {**record["recovery"], key: value}
    record["recovery"] = {k: v for k, v in item.items() if v != "DROP"}
    result = result_or_refusal(parse_record, json.dumps(record), "attempts.jsonl:7")
    if result is not None and result.recovery is not None:
        timed = (result.recovery.spare, result.recovery.abort_s, result.recovery.rendezvous_s)
        assert (result.recovery.fallback is None) == all(part is not None for part in timed)


def test_a_line_of_an_older_goodput_has_no_recovery_and_reads_as_a_fresh_start():
    record = json.loads(VALID)
    del record["recovery"]
    assert parse_record(json.dumps(record), "attempts.jsonl:7").recovery is None


@given(st.text(max_size=300), st.sampled_from(KEYS))
def test_a_record_with_a_key_renamed_or_text_added_is_refused(text, key):
    record = json.loads(VALID)
    record[text] = record.pop(key)
    if text != key:
        try:
            parse_record(json.dumps(record), "attempts.jsonl:7")
        except GoodputError as error:
            assert error.where == "attempts.jsonl:7"
        else:
            raise AssertionError(f"renaming {key!r} to {text!r} was accepted")


def _result(code: int, timed_out: bool, failed: str | None, steps, sig, suspects) -> AttemptResult:
    """A result as ``run_attempt`` gives it; its duration is zero, since a real one lies within
    the loop's own clock."""
    if steps is None:
        return AttemptResult(code, 0.0, timed_out, failed, 0, None, None, [], sig, None, suspects)
    first, span = steps
    last = first + span
    return AttemptResult(
        code, 0.0, timed_out, failed, span + 1, last, first, [], sig, 0.0, suspects
    )  # fmt: skip


# Suspects as forensics names them (printable lines), on hosts in and out of the pool.
suspects = st.lists(
    st.builds(
        Evidence,
        st.sampled_from([*HOSTS, "N2", "n3.hsn", "nid9"]),
        st.text(st.characters(blacklist_characters="\0"), min_size=1, max_size=80),
        st.just("hang-suspect"),
        st.one_of(st.none(), st.integers(0, 2**31)),
        st.one_of(st.none(), st.integers(0, 2**53)),
    ),
    max_size=3,
).map(tuple)


results = st.builds(
    _result,
    st.sampled_from([0, 1, 2, 3, 4, 124, 130, 137, 143, 255]),
    st.booleans(),
    st.one_of(st.none(), st.sampled_from(["0", "srun", "rank7"])),
    st.one_of(st.none(), st.tuples(st.integers(0, 10**15 - 10**6), st.integers(0, 10**6))),
    st.sampled_from([None, signal.SIGINT, signal.SIGTERM]),
    suspects,
)
# Output lines: any bytes, and evidence lines around hosts in and out of the pool, with bytes
# no record may hold (NUL) and bytes that are not UTF-8 inside what a pattern captures.
EVIDENCE_LINES = [
    b"srun: error: %s: task 1: Killed \0\x1b[1m",
    b"goodput: error: rank 3 on %s: \0\xff\x1b[31m CUDA error: an illegal memory access",
    b"\x1b[33mwarning: straggler: rank 3 on %s busy 1.62x the median over steps 12-31 "
    b"(0.231 s vs 0.143 s)\x1b[0m",
]
lines = st.one_of(
    st.binary(max_size=300),
    st.tuples(st.sampled_from(EVIDENCE_LINES), st.sampled_from([*HOSTS, "nid9", "n1.hsn"])).map(
        lambda pair: pair[0] % pair[1].encode()
    ),
)
probe_answers = st.dictionaries(
    st.sampled_from(HOSTS), st.text(st.characters(blacklist_characters="\0"), max_size=50)
)


@given(
    st.lists(results, min_size=1, max_size=4),
    st.lists(st.lists(lines, max_size=4), min_size=1, max_size=4),
    probe_answers,
    st.booleans(),
    st.integers(1, 4),
)
def test_whatever_the_loop_writes_reads_back(attempts, outputs, answers, auto, max_attempts):
    script = itertools.cycle(zip(attempts, itertools.cycle(outputs)))
    calls: list[AttemptResult] = []

    def start_attempt(hosts, on_line):
        result, output = next(script)
        for line in output:
            on_line(line)
        calls.append(result)
        return result

    def probe(hosts):
        failed = {host: said for host, said in answers.items() if host in hosts}
        return {
            host: Evidence(host, f"health probe {said}", "probe") for host, said in failed.items()
        }

    policy = Policy(max_attempts=max_attempts, backoff_s=0.0)
    if auto:
        policy = Policy(
            max_attempts=max_attempts,
            backoff_s=0.0,
            patterns=BAD_NODE_PATTERNS,
            probe=probe,
            max_stepless=2,
        )
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "attempts.jsonl"
        run_attempts(
            start_attempt,
            policy,
            Pool(HOSTS[:2], HOSTS[2:]),
            attempts_log=log,
            sleep=lambda seconds: None,
            resolve=lambda address: [],
        )
        records = read_attempts(log)
    assert [r.exit_code for r in records] == [c.exit_code for c in calls]
    assert [r.attempt for r in records] == list(range(1, len(calls) + 1))
    assert records[-1].decision == "stop"
