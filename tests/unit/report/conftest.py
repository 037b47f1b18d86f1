"""A synthetic run directory with every input the report draws: two attempts of one job (the
first lost to a bad node with a hostile evidence line, so steps 11-15 are recomputed), two
complete checkpoints, held-out and multiple-choice evals, an LR-finder curve written as
``goodput diagnose lr-find`` writes it, and busy time over ten hosts of two ranks (one rank slow,
a host named in markup and math) as the straggler watch writes it. The blend's mixture report is
added to the read files (a real blend manifest is the data tests' business)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from goodput import rundir
from goodput.diagnose.lr_find import CurvePoint, LrFindResult, RampSettings
from goodput.diagnose.lr_regions import find_regions, ramp
from goodput.eval.records import EvalRecord, append_evals
from goodput.io import write_json
from goodput.launch.history import Evidence
from goodput.report.accounting import Accounting, account
from goodput.report.run_files import RunFiles, read_run
from goodput.runfiles import BusyLine, CorpusShare, RankBusy, StageMixture, json_line
from goodput.testing.run_dirs import Attempt, write_run

T0 = 1_700_000_000.0
HOSTILE = "<script>alert(1)</script>"
# A task name matplotlib would read as (broken) math, and one that is markup.
MATH_TASK = r"mc $\frac$"
MARKUP_TASK = "<img src=x onerror=alert(1)>"
MIXTURE = [
    {"corpus": "web", "target": 0.7, "achieved": 0.68},
    {"corpus": "code", "target": 0.3, "achieved": 0.32},
]

# Three data-mix stages (runfiles.StageMixture): a corpus named as math, and one that wrapped.
STAGES = [
    StageMixture(0, "web.txt", (CorpusShare("web", 1.0, 1.0, False),)),
    StageMixture(8, "mix.txt", (CorpusShare("web", 0.5, 0.5, False),
                                CorpusShare(MATH_TASK, 0.5, 0.5, False))),
    StageMixture(16, "anneal.txt", (CorpusShare(MATH_TASK, 1.0, 1.0, True),)),
]  # fmt: skip


def build_run(run_dir: Path) -> None:
    first = Attempt(
        start=T0,
        startup_s=10.0,
        steps=range(1, 16),
        step_time_s=5.0,
        stalls={10: 2.0},
        tail_s=5.0,
        class_="bad-node",
        exit_code=1,
        job="101",
        wait_s=5.0,
        evidence=(Evidence(host="nid0002", said=f"{HOSTILE}\nmore", source="log"),),
        replaced={"nid0002": "nid0009"},
    )
    second = Attempt(
        start=first.end() + 5.0,
        startup_s=8.0,
        checkpoint_load_s=3.0,
        steps=range(11, 21),
        step_time_s=5.0,
        evals={20: 4.0},
        tail_s=2.0,
        job="101",
    )
    write_run(run_dir, [first, second], checkpoints=(10, 20), done=True)
    for step in (10, 20):
        progress = step / 20
        append_evals(
            run_dir,
            step,
            [
                EvalRecord("heldout/web", "loss", 6.0 - progress),
                EvalRecord("heldout/web", "perplexity", math.exp(6.0 - progress)),
                EvalRecord("heldout/code", "loss", 5.0 - progress),
                EvalRecord("arc-easy", "acc", 0.3 + 0.2 * progress, 0.02),
                EvalRecord("arc-easy", "acc_norm", 0.3 + 0.1 * progress, 0.02),
                EvalRecord("arc-easy", "chance", 0.25),
                EvalRecord(MATH_TASK, "acc", 0.5 + 0.1 * progress, 0.05),
                EvalRecord(MATH_TASK, "chance", 0.5),
                EvalRecord(MARKUP_TASK, "acc", 0.4, None),
            ],
            "train",
        )
    write_lr_find(run_dir)
    write_busy(run_dir)


BUSY_HOSTS = [f"nid{n:04d}" for n in range(9)] + [MATH_TASK + HOSTILE]
RANKS_PER_HOST = 2


def write_busy(run_dir: Path) -> None:
    """Windows of 5 steps over ten hosts of two ranks: rank 7 (on nid0003) lags from step 10
    on, and rank 19 (on the host named in markup and math) in the last two windows."""
    ranks = len(BUSY_HOSTS) * RANKS_PER_HOST
    with (run_dir / rundir.BUSY).open("w") as file:
        for step in range(5, 21, 5):
            means = {rank: 0.1 + 0.002 * rank for rank in range(ranks)}
            if step >= 10:
                means[7] += 0.06
            if step in (15, 20):
                means[ranks - 1] += 0.03
            named = sorted(means, key=lambda rank: -means[rank])[:5]
            values = sorted(means.values())
            line = BusyLine(
                step=step, steps=5, ranks=ranks,
                quantiles=(values[0], values[5], values[10], values[15], values[-1]),
                slowest=tuple(
                    RankBusy(rank, BUSY_HOSTS[rank // RANKS_PER_HOST], means[rank])
                    for rank in named
                ),
            )  # fmt: skip
            file.write(json_line(line.as_json(), where=file.name))


def write_lr_find(run_dir: Path) -> None:
    """A 40-step ramp that falls, bottoms out and diverges, as ``lr_find.run`` records it."""
    settings = RampSettings(num_steps=40, min_lr=1e-5, max_lr=10.0)
    lrs = ramp(settings.min_lr, settings.max_lr, settings.num_steps)
    losses = [5.0 - 2.0 * math.exp(-((math.log10(lr) + 2) ** 2)) + lr**2 for lr in lrs]
    curve = tuple(
        CurvePoint(step=i + 1, lr=lr, loss=loss, smoothed_loss=loss, grad_norm=1.0)
        for i, (lr, loss) in enumerate(zip(lrs, losses, strict=True))
    )
    regions = find_regions(lrs, losses, stopped_early=False)
    found = LrFindResult(settings, curve, False, regions)
    ramp_settings = {"steps": 40, "min_lr": settings.min_lr, "max_lr": settings.max_lr}
    write_json(run_dir / rundir.LR_FIND, {**found.as_json(), "ramp": ramp_settings})


CHROMIUM = Path("/usr/bin/chromium")  # Debian's, driven by playwright (which never downloads)
ROWS_JS = "() => Array.from(document.querySelectorAll('tr'), r => Array.from(r.cells, c => c.innerText.trim()))"  # noqa: E501


@dataclass(frozen=True)
class Rendered:
    problems: list[str]  # console errors, page errors and dialogs
    requested: list[str]  # every URL the page asked for but data: ones
    values: dict[str, Any]  # each script's result, evaluated once the page has loaded


@pytest.fixture
def render_in_chromium() -> Callable[[Path, dict[str, str]], Rendered]:
    """An HTML file as a real headless Chromium loads it, with named scripts run on it."""
    # A skip here fails under GOODPUT_REQUIRE_ALL=1 (tests/conftest.py): CI installs both.
    if not CHROMIUM.is_file():
        pytest.skip(f"needs Debian's chromium at {CHROMIUM} (apt-get install chromium)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="needs playwright (pip install -e '.[dev]')"
    )

    def render(path: Path, scripts: dict[str, str]) -> Rendered:
        problems: list[str] = []
        requested: list[str] = []
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=str(CHROMIUM), args=["--no-sandbox"]
            )
            try:
                page = browser.new_page()
                page.on("request", lambda request: requested.append(request.url))
                page.on("console", lambda m: m.type == "error" and problems.append(m.text))
                page.on("pageerror", lambda error: problems.append(str(error)))
                page.on("dialog", lambda dialog: problems.append(f"dialog: {dialog.message}"))
                page.goto(path.as_uri(), wait_until="load")
                values = {name: page.evaluate(script) for name, script in scripts.items()}
            finally:
                browser.close()
        return Rendered(problems, [r for r in requested if not r.startswith("data:")], values)

    return render


@pytest.fixture
def chromium_rows(tmp_path, render_in_chromium) -> Callable[[str], list[list[str]]]:
    """Every table row of an HTML page as a real headless Chromium renders it: each cell's text,
    as a reader sees it."""

    def rows(page: str) -> list[list[str]]:
        path = tmp_path / "report.html"
        path.write_text(page)
        return render_in_chromium(path, {"rows": ROWS_JS}).values["rows"]

    return rows


@pytest.fixture(scope="session")
def full_run(tmp_path_factory) -> tuple[RunFiles, Accounting]:
    """The synthetic run, read; its directory's name is markup too."""
    run_dir = tmp_path_factory.mktemp("report") / "run<b>&amp;"
    build_run(run_dir)
    run = replace(read_run(run_dir), mixture=MIXTURE, stages=STAGES)
    return run, account(run)
