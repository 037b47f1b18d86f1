"""The attempts log: records round-trip, and a line that is not exactly a record is refused
with FILE:LINE, as a run report must see it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from goodput.errors import GoodputError
from goodput.launch.history import AttemptRecord, Evidence, append_record, read_attempts

RECORD = AttemptRecord(
    attempt=1,
    of=None,
    job="4242.pbs",
    class_="bad-node",
    exit_code=137,
    timed_out=False,
    first_failure_label="1",
    started="2025-01-02T03:04:05.000+00:00",
    first_step_at="2025-01-02T03:04:09.250+00:00",
    ended="2025-01-02T03:05:00.500+00:00",
    steps_seen=3,
    first_step=11,
    last_step=13,
    steps_gained=3,
    hosts=("n1", "n2"),
    evidence=(Evidence("n2", "=   PID 7 RUNNING AT n2\n=   EXIT CODE: 9", "log"),),
    replaced={"n2": "n3"},
    spares_left=("n4",),
    decision="retry",
    reason=None,
    wait_s=2.5,
)
STOP = dataclasses.replace(
    RECORD,
    attempt=2,
    class_="success",
    exit_code=0,
    hosts=("n1", "n3"),
    evidence=(),
    replaced={},
    decision="stop",
    reason="done",
    wait_s=None,
)


def test_records_round_trip_with_every_key_and_the_class(tmp_path):
    log = tmp_path / "run" / "attempts.jsonl"
    append_record(log, RECORD)
    append_record(log, STOP)
    assert read_attempts(log) == [RECORD, STOP]
    first = json.loads(log.read_text().splitlines()[0])
    assert first["class"] == "bad-node" and "class_" not in first
    said = RECORD.evidence[0].said
    assert first["evidence"] == [
        {"host": "n2", "said": said, "source": "log", "rank": None, "step": None}
    ]
    assert len(first) == len(dataclasses.fields(AttemptRecord))


def test_suspect_and_straggler_evidence_round_trips_with_rank_and_step(tmp_path):
    log = tmp_path / "attempts.jsonl"
    suspect = Evidence("n2", "hang suspect: rank 3 on n2 (pid 7) stopped", "hang-suspect", 3, 37)
    slow = Evidence("n1", "warning: straggler: rank 0 on n1 busy 1.62x", "straggler", 0, 31)
    record = dataclasses.replace(RECORD, class_="straggler", exit_code=4, evidence=(slow, suspect))
    append_record(log, record)
    assert read_attempts(log) == [record]


def test_an_older_line_without_rank_and_step_still_reads(tmp_path):
    """A line written before evidence had ``rank`` and ``step`` (issue 27) reads with both None."""
    line = RECORD.to_json()
    line["evidence"] = [{"host": "n2", "said": "killed", "source": "log"}]
    log = tmp_path / "attempts.jsonl"
    log.write_text(json.dumps(line) + "\n")
    assert read_attempts(log)[0].evidence == (Evidence("n2", "killed", "log", None, None),)


def test_an_empty_log_has_no_records(tmp_path):
    (tmp_path / "attempts.jsonl").write_text("")
    assert read_attempts(tmp_path / "attempts.jsonl") == []


def _edited(**changes) -> str:
    line = {**RECORD.to_json(), **changes}
    return json.dumps({key: value for key, value in line.items() if value != "DROP"})


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "is not a JSON line"),
        ("[1, 2]", "is not an object of attempt record keys"),
        (_edited(class_="bad-node"), "is not an object of attempt record keys"),
        (_edited(**{"class": "DROP"}), "'class' is not set"),
        (_edited(**{"class": "lucky"}), "'class' = 'lucky' is not allowed"),
        (_edited(colour="red"), "unknown key 'colour'"),
        (_edited(exit_code="137"), "'exit_code' must be int"),
        (_edited(exit_code=300), "'exit_code' = 300 is not in"),
        (_edited(last_step=2**60), "'last_step' = 1152921504606846976 is not in"),
        (_edited(wait_s=float("nan")), "'wait_s' = nan is not in"),
        (_edited(hosts="n1"), "'hosts' must be a list"),
        (_edited(evidence=[{"host": "n2", "said": "x", "source": "rumour"}]), "'rumour'"),
        (_edited(evidence=[{"host": "n2", "said": "x", "source": "log", "rank": -1}]), "-1"),
        (_edited(evidence=[{"host": "n2", "said": "x", "source": "log", "step": "7"}]), "int"),
        (_edited(replaced={"n2": 3}), "'replaced' must map host names to host names"),
        (_edited(replaced={"n9": "n3"}), "'replaced' names a host the attempt did not run on"),
        (_edited(started="yesterday"), "'yesterday' is not an ISO 8601 time"),
        (_edited(started="2025-01-02T03:04:05"), "has no time zone"),
        (_edited(started="2025-01-02T04:00:00+00:00"), "out of order"),
        (_edited(first_step=None), "steps_seen, first_step and last_step disagree"),
        (_edited(decision="stop", replaced={}), "a stop has a reason and no wait_s"),
        (_edited(decision="stop", reason="done", wait_s=None), "replaced only for a next"),
        (_edited(exit_code=0), "class bad-node with exit code 0"),
        (_edited(attempt=3, of=2), "attempt 3 of 2"),
    ],
)
def test_a_bad_line_is_named_by_file_and_line(tmp_path, line, message):
    log = tmp_path / "attempts.jsonl"
    log.write_text(json.dumps(RECORD.to_json()) + "\n" + line + "\n")
    with pytest.raises(GoodputError) as refused:
        read_attempts(log)
    assert refused.value.where == f"{log}:2"
    assert message in refused.value.what


def test_a_line_cut_short_is_refused(tmp_path):
    log = tmp_path / "attempts.jsonl"
    log.write_text(json.dumps(RECORD.to_json()) + "\n" + json.dumps(STOP.to_json()))
    with pytest.raises(GoodputError, match=r"attempts.jsonl:2: has no newline"):
        read_attempts(log)
