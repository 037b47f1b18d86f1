"""The report's data-mix stages, from run.json's ``data.stages`` (``runfiles.StageMixture``):
the terminal table, ``--json``'s ``stages``, the page's table and figure through the real
``goodput report`` command; none of them for a run of one mixture; the figure bounded however
many stages; and a damaged record one error naming run.json and the stage."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from goodput import cli, rundir
from goodput.errors import GoodputError
from goodput.report.accounting import account
from goodput.report.plots import STAGES_DRAWN, STAGES_PER_ROW, stage_mixture_plot
from goodput.report.run_files import read_run
from goodput.runfiles import CorpusShare, StageMixture
from goodput.testing.run_dirs import Attempt, write_run

STAGES = [
    StageMixture(0, "broad.txt", (CorpusShare("code", 0.5, 0.5, False),
                                  CorpusShare("docs", 0.5, 0.5, False))),
    StageMixture(6, "anneal.txt", (CorpusShare("<b>docs</b>", 1.0, 1.0, True),)),
]  # fmt: skip


def staged_run(run_dir: Path, stages: list[dict]) -> Path:
    write_run(run_dir, [Attempt(start=1e9, startup_s=1.0, steps=range(1, 9))], done=True)
    record = {"data": {"blend": str(run_dir / "no-blend"), "stages": stages}}
    (run_dir / rundir.RUN_RECORD).write_text(json.dumps(record))
    return run_dir


def report(capsys, *args: object) -> tuple[int, str]:
    code = cli.main(["report", *map(str, args)])
    return code, capsys.readouterr().out


def test_every_view_shows_each_stages_mixture(tmp_path, capsys):
    run_dir = staged_run(tmp_path / "run", [stage.as_json() for stage in STAGES])
    assert read_run(run_dir).stages == STAGES
    code, out = report(capsys, run_dir)
    assert code == 0 and "data-mix stages" in out
    (row,) = [line.split("│")[1:-1] for line in out.splitlines() if "<b>docs</b>" in line]
    assert [cell.strip() for cell in row] == [
        "1",
        "6",
        "<b>docs</b>",
        "100.00",
        "100.00",
        "wrapped",
    ]
    code, out = report(capsys, run_dir, "--json")
    assert code == 0 and json.loads(out)["stages"] == [stage.as_json() for stage in STAGES]
    page = tmp_path / "report.html"
    code, _ = report(capsys, run_dir, "--html", page)
    html = page.read_text()
    assert code == 0 and "<h2>Data-mix stages</h2>" in html and "<figure id='stages'>" in html
    assert "&lt;b&gt;docs&lt;/b&gt;" in html and "<b>docs</b>" not in html  # text, not markup


def test_a_run_of_one_mixture_shows_no_stages(tmp_path, capsys):
    run_dir = staged_run(tmp_path / "run", [STAGES[0].as_json()])
    code, out = report(capsys, run_dir)
    assert code == 0 and "data-mix stages" not in out
    page = tmp_path / "report.html"
    report(capsys, run_dir, "--html", page)
    assert "Data-mix stages</h2>" not in page.read_text()


GOOD = STAGES[0].as_json()


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ("all", "'data.stages' is not a list of at most 1000"),
        ([GOOD] * 1001, "'data.stages' is not a list of at most 1000"),
        ([3], "data.stages[0]: is not an object"),
        ([{**GOOD, "start_step": -1}], "data.stages[0]: 'start_step' is -1, not a whole number"),
        ([{**GOOD, "start_step": 1.5}], "'start_step' is 1.5, not a whole number"),
        ([{k: v for k, v in GOOD.items() if k != "file_list"}], "'file_list' is missing"),
        ([{**GOOD, "file_list": ""}], "'file_list' is \"\", not a path"),
        ([{**GOOD, "corpora": {}}], "'corpora' is an object, not a list"),
        ([GOOD, {**GOOD, "corpora": [7]}], "data.stages[1].corpora[0]: is not an object"),
        ([{**GOOD, "corpora": [{**GOOD["corpora"][0], "target": 1.5}]}],
         "data.stages[0].corpora[0]: 'target' is 1.5, not a number from 0 to 1"),
        ([{**GOOD, "corpora": [{**GOOD["corpora"][0], "achieved": None}]}],
         "'achieved' is null, not a number from 0 to 1"),
        ([{**GOOD, "corpora": [{**GOOD["corpora"][0], "wrapped": 1}]}],
         "'wrapped' is 1, not true or false"),
        ([{**GOOD, "corpora": [{**GOOD["corpora"][0], "corpus": ""}]}], "'corpus' is \"\""),
        ([{**GOOD, "corpora": [GOOD["corpora"][0]] * 10_001}], "has more than 10000 corpora"),
    ],
)  # fmt: skip
def test_a_damaged_stage_record_is_one_error_naming_it(tmp_path, stages, message):
    run_dir = staged_run(tmp_path / "run", stages)
    with pytest.raises(GoodputError) as caught:
        read_run(run_dir)
    rendered = caught.value.render()
    assert rendered.startswith(str(run_dir / rundir.RUN_RECORD)) and "\n" not in rendered
    assert message in rendered


def test_the_figure_draws_the_first_stages_only(tmp_path):
    run_dir = staged_run(tmp_path / "run", [stage.as_json() for stage in STAGES])
    run = replace(read_run(run_dir), stages=STAGES * 32)  # 64 stages
    png = stage_mixture_plot(run, account(run))
    assert png is not None
    width, height = struct.unpack(">II", png[16:24])  # the PNG header's IHDR
    rows = -(-STAGES_DRAWN // STAGES_PER_ROW)
    assert width == 800 and height == rows * 350
