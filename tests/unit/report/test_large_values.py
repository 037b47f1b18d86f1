"""``goodput report`` on runs whose numbers are finite and huge (the run files admit any finite
number): a trailing mean of 1e308 losses once overflowed to ``inf``, which every run then
"reached at 1 tokens, 100x fewer", and the page's figures failed inside matplotlib. Real
processes, as a user meets them: the verdicts are read off finite numbers, ``--json`` is strict
JSON, ``--html`` draws every figure."""

from __future__ import annotations

import json
import sys

import pytest

from goodput import rundir
from goodput.testing.fuzz import strict_json
from goodput.testing.jobs import run_goodput

T0 = 1_800_000_000.0
STEPS = 100
TOKENS_PER_STEP = 100


def huge_run(run_dir, loss):
    """``STEPS`` steps of ``loss``, and every other number of the line as large as it gets."""
    run_dir.mkdir()
    big = sys.float_info.max
    lines = [
        {"step": step, "loss": loss, "grad_norm": big, "lr": big, "tokens_per_s": big, "mfu": big,
         "heldout_loss/web": -big, "tokens": step * TOKENS_PER_STEP, "step_time_s": 1.0,
         "time": T0 + step}
        for step in range(1, STEPS + 1)
    ]  # fmt: skip
    (run_dir / rundir.METRICS).write_text("".join(json.dumps(line) + "\n" for line in lines))
    slowest = [[1, "nid1", big], [0, "nid0", big / 2], [2, "nid2", 5e-324]]
    busy = [
        {"step": step, "steps": 10, "ranks": 3, "quantiles": [0.0, 5e-324, 1e300, big, big],
         "slowest": slowest}
        for step in range(10, STEPS + 1, 10)
    ]  # fmt: skip
    (run_dir / rundir.BUSY).write_text("".join(json.dumps(line) + "\n" for line in busy))


def test_huge_losses_give_finite_verdicts(tmp_path):
    huge_run(tmp_path / "a", 1.7e308)
    huge_run(tmp_path / "b", 1.6e308)
    runs = (tmp_path / "a", tmp_path / "b")
    shown = run_goodput("report", *runs)
    assert shown.returncode == 0, shown.stderr
    assert "inf" not in shown.stdout and "1.7e+308" in shown.stdout
    assert "a reaches b's final loss 1.6e+308: never" in shown.stdout
    assert "b reaches a's final loss 1.7e+308 at 100 tokens, a took 10K" in shown.stdout
    found = run_goodput("report", *runs, "--json")
    assert found.returncode == 0, found.stderr
    comparison = strict_json(found.stdout)
    means = comparison["runs"][0]["series"]["loss"]["value"]
    assert means == pytest.approx([1.7e308] * STEPS, rel=1e-15)  # a mean's rounding
    targets = [reach["target"] for reach in comparison["reaches"]]
    assert targets == pytest.approx([1.6e308, 1.7e308, -sys.float_info.max, -sys.float_info.max])
    page = tmp_path / "compare.html"
    drawn = run_goodput("report", *runs, "--html", page)
    assert drawn.returncode == 0, drawn.stderr
    assert page.read_text().count("<figure") == 2  # the loss and the held-out loss


def test_huge_seconds_and_rates_draw_on_the_page(tmp_path):
    huge_run(tmp_path / "run", 1e308)
    page = tmp_path / "report.html"
    drawn = run_goodput("report", tmp_path / "run", "--html", page)
    assert drawn.returncode == 0, drawn.stderr
    text = page.read_text()
    for figure in ("loss", "grad-norm", "lr", "throughput", "busy"):
        assert f"<figure id='{figure}'>" in text
