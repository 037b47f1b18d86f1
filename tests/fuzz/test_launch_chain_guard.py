"""Fuzz the job chain's guard (``python -m goodput.launch.submit``), which each job runs on what
the job before passed it in ``GOODPUT_CHAIN_PREVIOUS`` and on the attempts log in the run folder.

Properties: any value of the variable is up to two job ids or a one-line ``GoodputError``; and
the guard itself, given any value and any bytes as the attempts log, exits 0, 1 or 2 with at
most one line on stderr, never a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.launch.env import JOB_ID
from goodput.launch.submit import MAX_STEPLESS_JOBS, main, parse_jobs
from goodput.testing.fuzz import result_or_refusal

IDS = st.sampled_from(["41", "42.pbs", "7[3].server", "a-b_c"])
JOB_TEXT = st.text(max_size=300) | st.lists(IDS | st.text(max_size=8), max_size=4).map(",".join)


def _record_line(job: str, steps: int) -> bytes:
    """One valid attempts line of ``job``, which gained ``steps`` steps."""
    record = {
        "attempt": 1,
        "of": 1,
        "job": job,
        "class": "error",
        "exit_code": 1,
        "timed_out": False,
        "first_failure_label": "srun",
        "started": "2025-01-01T00:00:00.000+00:00",
        "first_step_at": None,
        "ended": "2025-01-01T00:00:01.000+00:00",
        "steps_seen": 0,
        "first_step": None,
        "last_step": None,
        "steps_gained": steps,
        "hosts": ["n1"],
        "evidence": [],
        "replaced": {},
        "spares_left": [],
        "decision": "stop",
        "reason": "no retries left",
        "wait_s": None,
    }
    return (json.dumps(record) + "\n").encode()


# Garbage, or valid lines of the ids above with and without steps (stops and go-ons).
ATTEMPTS = st.binary(max_size=600) | st.lists(
    st.builds(_record_line, IDS, st.integers(0, 2)), max_size=4
).map(b"".join)


@given(JOB_TEXT)
def test_any_previous_jobs_value_is_job_ids_or_one_line(text):
    jobs = result_or_refusal(parse_jobs, text)
    if jobs is not None:
        assert len(jobs) <= MAX_STEPLESS_JOBS and ",".join(jobs) == text
        assert all(JOB_ID.fullmatch(job) for job in jobs)


@given(JOB_TEXT, ATTEMPTS)
def test_the_guard_exits_with_one_line_whatever_it_reads(text, attempts):
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "attempts.jsonl").write_bytes(attempts)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = main(["--launch-run-dir", folder, "--", text])
    assert code in (0, 1, 2)
    assert len(stderr.getvalue().splitlines()) == (code != 0)
