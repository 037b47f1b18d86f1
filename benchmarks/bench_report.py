"""``goodput report`` on a long run: 10,000 steps over 50 attempts (one job each, the chain's
queue gaps between them, every other attempt ending in a crash whose last steps are recomputed),
written by ``goodput.testing.run_dirs`` as the trainer and launcher write them.

Ours: ``read_run`` + ``account`` + the terminal summary rendered to a string + the ``--json``
object, and separately the HTML page with its plots (matplotlib). Baseline: reading the same
files with plain ``json`` (every line of metrics.jsonl and attempts.jsonl ``json.loads``-ed,
nothing checked, nothing computed): the least any reader does. Target: the report in well under a
few seconds, so it is never the slow part. Median of ``REPEATS`` runs each.
"""

from __future__ import annotations

import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from goodput.report.accounting import account
from goodput.report.run_files import read_run
from goodput.testing.run_dirs import Attempt, write_run

NUM_STEPS = 10_000
NUM_ATTEMPTS = 50
REPEATS = 5


def synthetic_run(run_dir: Path) -> None:
    per_attempt = NUM_STEPS // NUM_ATTEMPTS
    attempts, clock, first = [], 1_800_000_000.0, 1
    for index in range(NUM_ATTEMPTS):
        crashed = index % 2 == 0 and index < NUM_ATTEMPTS - 1
        # A crashed attempt's last 10 steps are run again by the next one.
        last = first + per_attempt - 1 + (10 if crashed else 0)
        attempt = Attempt(
            start=clock, startup_s=30, steps=range(first, last + 1), step_time_s=2.0,
            data_time_s=0.01, stalls={first + 50: 1.5}, evals={first + 100: 20.0},
            tail_s=5, class_="error" if crashed else "walltime",
            exit_code=1 if crashed else 143, job=str(1000 + index),
            wait_s=None if not crashed else 10.0,
        )  # fmt: skip
        attempts.append(attempt)
        clock = attempt.end() + 300  # the next job's time in the queue
        first = last + 1 - (10 if crashed else 0)
    last_attempt = attempts[-1]
    attempts[-1] = Attempt(**{**_fields(last_attempt), "class_": "success", "exit_code": 0})
    write_run(run_dir, attempts, checkpoints=range(100, NUM_STEPS + 1, 100), done=True)


def _fields(attempt: Attempt) -> dict[str, Any]:
    return {name: getattr(attempt, name) for name in attempt.__dataclass_fields__}


def plain_json(run_dir: Path) -> int:
    count = 0
    for name in ("metrics.jsonl", "attempts.jsonl"):
        with open(run_dir / name) as lines:
            for line in lines:
                json.loads(line)
                count += 1
    return count


def ours(run_dir: Path) -> float:
    from rich.console import Console

    from goodput.report.terminal import summary

    run = read_run(run_dir)
    acc = account(run)
    Console(file=io.StringIO(), width=120).print(summary(run, acc))
    json.dumps(acc.as_json())
    return acc.goodput


def html(run_dir: Path, out: Path) -> None:
    from goodput.report.html import write_html

    run = read_run(run_dir)
    write_html(run, account(run), out)


def _median_s(action: Any, *args: Any) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        action(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-report-") as scratch:
        run_dir = Path(scratch) / "run"
        synthetic_run(run_dir)
        lines = plain_json(run_dir)
        baseline = _median_s(plain_json, run_dir)
        report = _median_s(ours, run_dir)
        page = _median_s(html, run_dir, Path(scratch) / "report.html")
        goodput = ours(run_dir)
    result = {
        "steps": NUM_STEPS,
        "attempts": NUM_ATTEMPTS,
        "lines": lines,
        "plain_json_s": baseline,
        "report_s": report,
        "report_vs_plain_json": report / baseline,
        "html_s": page,
        "goodput": goodput,
    }
    print(
        f"report: {NUM_STEPS:,} steps, {NUM_ATTEMPTS} attempts: plain json {baseline:.3f} s, "
        f"goodput report {report:.3f} s ({report / baseline:.1f}x), --html {page:.2f} s; "
        f"goodput {goodput:.3f}"
    )
    return result
