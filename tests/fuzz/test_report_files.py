"""Fuzz what ``goodput report`` reads from a run directory: any bytes, and JSON lines shaped like
the trainer's metrics, the evals log and lr_find.json with any value in any field, give a
report or one GoodputError naming the file — never a traceback, never a write."""

import json
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.report.accounting import account
from goodput.report.run_files import read_run
from goodput.runfiles import RESUMED_FROM
from goodput.testing import fuzz

values = fuzz.json_values(0, 1, 1.5, 1e300, -1, "x", "snapshot", "partner", "checkpoint")
step_lines = st.fixed_dictionaries(
    {"step": values | st.integers(0, 10), "time": values | st.floats(0, 2e9),
     "step_time_s": values | st.floats(0, 10)},
    optional={"tokens_per_s": values, "data_time_s": values, "startup_s": values,
              "checkpoint_stall_s": values, "eval_time_s": values, "loss": values,
              "snapshot_stall_s": values, "resumed_from": values, "resumed_step": values},
)  # fmt: skip
eval_lines = st.fixed_dictionaries(
    {"step": values, "task": values | st.text(max_size=5), "metric": values,
     "value": values, "stderr": values, "source": values},
)  # fmt: skip


def report_or_refusal(files: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch) / "run"
        run_dir.mkdir()
        for name, data in files.items():
            (run_dir / name).write_bytes(data)
        before = sorted(p.name for p in run_dir.iterdir())
        run = fuzz.result_or_refusal(read_run, run_dir)
        if run is not None:
            acc = account(run)
            assert acc.wall_s >= 0 and acc.productive_s >= 0
            json.dumps(acc.as_json(), allow_nan=False)
            for attempt in acc.attempts:  # a resume the reader let through is a known source
                assert attempt.loaded_from().split(" @ ")[0] in ("-", "?", *RESUMED_FROM)
        assert sorted(p.name for p in run_dir.iterdir()) == before  # it never writes


def jsonl(records: list) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_any_bytes(metrics, evals):
    report_or_refusal({"metrics.jsonl": metrics, "evals.jsonl": evals})


@given(st.lists(step_lines, max_size=6), st.lists(eval_lines, max_size=3))
def test_lines_shaped_like_the_trainers(steps, evals):
    report_or_refusal({"metrics.jsonl": jsonl(steps), "evals.jsonl": jsonl(evals)})


@given(values | st.fixed_dictionaries({"curve": st.lists(values, max_size=3) | values}))
def test_lr_find_files(found):
    line = {"step": 1, "time": 10.0, "step_time_s": 1.0}
    report_or_refusal({"metrics.jsonl": jsonl([line]), "lr_find.json": json.dumps(found).encode()})
