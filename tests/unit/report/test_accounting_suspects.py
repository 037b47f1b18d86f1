"""A hang's suspect and a straggler's eviction in the report: the attempt row shows the suspect's
line (its rank and host) in the terminal summary and on the page, checked in headless Chromium as
test_html.py does; an eviction's save-and-stop is ``shutdown``, not ``hang``."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from goodput.launch.history import Evidence
from goodput.report.accounting import account
from goodput.report.html import render_html
from goodput.report.run_files import read_run
from goodput.report.terminal import summary
from goodput.testing.run_dirs import Attempt, write_run

T0 = 1_800_000_000.0
SUSPECT = (
    "hang suspect: rank 1 on nid0001 (pid 4411) not in a collective at step 4, phase data, "
    "while 1 rank(s) wait in step.tokens; stack: faults.py:210 stall <- loop.py:118 train"
)
WARNING = (
    "warning: straggler: rank 1 on nid0001 busy 1.62x the median over steps 1-4 "
    "(0.231 s vs 0.143 s)"
)
WARNED = Evidence("nid0001", WARNING, "straggler", 1, 4)
# The loop records suspects first; the row shows the suspect wherever it stands.
HUNG = Attempt(
    start=T0, startup_s=5, steps=range(1, 5), tail_s=3, class_="hang", exit_code=124,
    timed_out=True, job="7", wait_s=1,
    evidence=(WARNED, Evidence("nid0001", SUSPECT, "hang-suspect", 1, 4)),
)  # fmt: skip
EVICTED = Attempt(
    start=HUNG.end() + 1, startup_s=4, steps=range(3, 9), tail_s=2, class_="straggler",
    exit_code=4, job="7", wait_s=1, host="nid0002",
    evidence=(Evidence("nid0001", WARNING.replace("1-4", "3-8"), "straggler", 1, 8),),
    replaced={"nid0001": "nid0009"},
)  # fmt: skip
DONE = Attempt(start=EVICTED.end() + 1, startup_s=4, steps=range(9, 12), job="7")


@pytest.fixture
def run(tmp_path):
    write_run(tmp_path, [HUNG, EVICTED, DONE], checkpoints=(4, 8), done=True)
    files = read_run(tmp_path)
    return files, account(files)


def test_the_hang_row_shows_its_suspect_and_the_eviction_row_its_straggler(run):
    _, acc = run
    hung, evicted, done = acc.attempts
    assert hung.evidence == SUSPECT[:200] and hung.class_ == "hang"
    assert evicted.class_ == "straggler" and evicted.evidence.startswith("warning: straggler:")
    assert evicted.hosts_evicted == ["nid0001"] and done.evidence is None
    # Each attempt's last step to its end: the watchdog's wait, then the save-and-stop.
    assert acc.badput_s["hang"] == pytest.approx(HUNG.tail_s)
    assert acc.badput_s["shutdown"] == pytest.approx(EVICTED.tail_s)


def test_the_terminal_summary_names_the_suspects_rank_and_host(run):
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(summary(*run))
    rows = [line.split("│") for line in out.getvalue().splitlines() if "│ 7 " in line]
    cells = {row[4].strip(): row[9].strip() for row in rows}  # evidence by class
    assert cells["hang"].startswith("hang suspect: rank 1 on nid0001 (pid 4411)")
    assert cells["straggler"] == EVICTED.evidence[0].said + " (evicted nid0001)"


def test_the_page_names_the_suspect_in_chromium(run, chromium_rows):
    rows = chromium_rows(render_html(*run))
    attempts = {row[2]: row for row in rows if len(row) == 12}  # the attempt table's, by class
    assert attempts["hang"][9] == SUSPECT
    assert attempts["straggler"][9] == EVICTED.evidence[0].said
    assert attempts["straggler"][10] == "nid0001"
