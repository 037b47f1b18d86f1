"""``goodput report`` on a run at Aurora's width (10,624 hosts of 12 ranks), CI-sized in time
(2,000 steps, a straggler-watch window every 20): the run ``goodput.testing.scale_runs`` writes,
the one ``python -m benchmarks control`` measures at 100,000 steps. Real processes, as a user
runs them: the summary, strict ``--json`` and a page that a real Chromium draws, its busy
figure naming the two ranks the run makes lag."""

from __future__ import annotations

import pytest

from goodput.report import plots
from goodput.report.run_files import read_run
from goodput.testing.fuzz import strict_json
from goodput.testing.scale_runs import ScaleRun, measure_goodput, write_scale_run

SHAPE = ScaleRun(steps=2_000)
# Generous: the issue bounds the full run (100,000 steps) at 10 s and 2 GiB; a run 50 times
# shorter that took a minute, or held a GiB, would have lost the bound's design.
BOUND_S = 60.0
BOUND_MIB = 1024.0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("scale") / "run"
    write_scale_run(run_dir, SHAPE)
    return run_dir


@pytest.mark.timeout(600)
def test_the_summary_and_json_of_127488_ranks(run_dir):
    text = measure_goodput("report", run_dir)
    assert text.returncode == 0, text.stderr
    assert "goodput" in text.stdout
    found = measure_goodput("report", run_dir, "--json")
    assert found.returncode == 0, found.stderr
    account = strict_json(found.stdout)
    assert account["steps"] == {"kept": SHAPE.steps, "recomputed": 0, "last": SHAPE.steps,
                                "done": True}  # fmt: skip
    assert len(account["attempts"]) == SHAPE.attempts
    for one in (text, found):
        assert one.wall_s < BOUND_S and one.peak_rss_mib < BOUND_MIB


@pytest.mark.timeout(600)
def test_the_page_draws_in_chromium_and_names_the_lagging_ranks(
    run_dir, tmp_path, render_in_chromium
):
    page = tmp_path / "report.html"
    drawn = measure_goodput("report", run_dir, "--html", page)
    assert drawn.returncode == 0, drawn.stderr
    assert drawn.wall_s < BOUND_S and drawn.peak_rss_mib < BOUND_MIB
    rendered = render_in_chromium(
        page,
        {
            "busy": "() => { const i = document.querySelector('#busy img');"
            " return [i.complete, i.naturalWidth, i.naturalHeight]; }",
            "images": "() => Array.from(document.images, i => i.complete && i.naturalWidth > 0)",
        },
    )
    assert rendered.problems == [] and rendered.requested == [page.as_uri()]
    assert rendered.values["busy"] == [True, 800, 350]
    assert all(rendered.values["images"])
    # The figure's named ranks: the steady straggler first, then the flapping one, each with its
    # host; and no more names than the figure has room for.
    figure = plots.busy_figure(read_run(run_dir))
    assert figure is not None
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    steady = f"{SHAPE.host(SHAPE.steady)} rank {SHAPE.steady} "
    flapping = f"{SHAPE.host(SHAPE.flapping)} rank {SHAPE.flapping} "
    assert labels[4].startswith(steady) and labels[5].startswith(flapping)
    assert len(labels) == 4 + plots.BUSY_RANKS
