"""``goodput report RUN_A RUN_B ...`` on real tiny runs (the real ``train()``, its metrics and
evals writers): a job chain (4 steps, then resumed to 8 by a second process), the same run on
two FSDP ranks, and a run at a hundredth of the learning rate. On the tokens axis the chain and
the two-rank run log the same losses at the same tokens; the faster run reaches the slower
one's final loss in fewer tokens and the slower one never reaches the faster one's. The page is
checked in a real headless Chromium, and docs/report.md's "Comparing runs" commands run as
written."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from goodput import rundir
from goodput.cli import main
from goodput.eval.config import EvalConfig
from goodput.report.compare import LOSS, compare_runs
from goodput.report.compare_views import render_comparison_html, series_figure
from goodput.runfiles import read_steps
from goodput.testing.dist import run_distributed
from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO, outside_any_job
from goodput.testing.tiny import tiny_run_config, write_counting_corpus
from goodput.train.config.run import RunConfig
from goodput.train.loop import train

pytestmark = pytest.mark.timeout(900)
NUM_STEPS = 8
REL_TOLERANCE = 1e-5  # two layouts sum in another order (tests/unit/train/test_layout_invariance)


def train_on_rank(rank: int, world_size: int, cfg: RunConfig) -> None:
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    train(cfg)


def run_config(base: RunConfig, run_dir: Path, *, steps: int = NUM_STEPS, lr: float = 1e-2):
    return replace(
        base,
        train=replace(base.train, steps=steps, run_dir=str(run_dir), tensorboard=False),
        schedule=replace(base.schedule, lr=lr),
        eval=EvalConfig(interval_steps=4, holdout_samples=4),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    base = tiny_run_config(root)
    chain, fsdp, slow = root / "chain", root / "fsdp", root / "slow"
    train(run_config(base, chain, steps=4))  # the first job, then its resume
    train(run_config(base, chain))
    run_distributed(train_on_rank, 2, run_config(base, fsdp), timeout_s=600)
    train(run_config(base, slow, lr=1e-4))
    return {"chain": chain, "fsdp": fsdp, "slow": slow}


def test_the_runs_line_up_on_tokens_across_a_chain_and_layouts(runs):
    lines = list(read_steps(runs["chain"] / rundir.METRICS))
    assert sum("startup_s" in line.raw for line in lines) == 2  # two processes wrote it
    comparison = compare_runs([runs["chain"], runs["fsdp"], runs["slow"]])
    chain, fsdp, slow = comparison.runs
    for run in comparison.runs:
        assert not run.tokens_derived  # every line says its tokens
        tokens = [t for t, _ in run.series[LOSS].points]
        assert len(tokens) == NUM_STEPS and tokens == [
            tokens[0] * (i + 1) for i in range(NUM_STEPS)
        ]
    assert [t for t, _ in chain.series[LOSS].raw or ()] == [
        t for t, _ in fsdp.series[LOSS].raw or ()
    ]
    for (_, one), (_, two) in zip(
        chain.series[LOSS].raw or (), fsdp.series[LOSS].raw or (), strict=True
    ):
        assert math.isclose(one, two, rel_tol=REL_TOLERANCE)
    assert set(chain.series) == set(fsdp.series) == set(slow.series)
    assert "heldout/counting" in chain.series and len(chain.series["heldout/counting"].points) == 2


def test_the_faster_run_reaches_the_slower_ones_loss_in_fewer_tokens(runs):
    comparison = compare_runs([runs["chain"], runs["slow"]])
    found = {(reach.series, reach.run): reach for reach in comparison.reaches}
    fast = found[LOSS, "chain"]
    assert fast.tokens is not None and fast.tokens < fast.target_tokens and fast.ratio > 1
    assert found[LOSS, "slow"].tokens is None
    assert found["heldout/counting", "slow"].tokens is None


def test_each_figure_names_every_run_in_its_legend(runs):
    comparison = compare_runs([runs["chain"], runs["fsdp"], runs["slow"]])
    for name in comparison.series_names():
        legend = series_figure(comparison, name).axes[0].get_legend()
        assert [text.get_text() for text in legend.get_texts()] == ["chain", "fsdp", "slow"]


def test_the_page_renders_in_chromium(runs, tmp_path, capsys, render_in_chromium):
    out = tmp_path / "compare.html"
    argv = ["report", str(runs["chain"]), str(runs["slow"]), "--html", str(out)]
    assert main(argv) == 0
    comparison = compare_runs([runs["chain"], runs["slow"]])
    assert out.read_text() == render_comparison_html(comparison)
    rendered = render_in_chromium(
        out,
        {
            "images": "() => Array.from(document.images, i => [i.complete, i.naturalWidth, i.alt])",
            "captions": "() => Array.from(document.querySelectorAll('figcaption b'),"
            " b => b.innerText)",
            "text": "() => document.body.innerText",
        },
    )
    images, captions, text = (rendered.values[k] for k in ("images", "captions", "text"))
    assert rendered.problems == [] and rendered.requested == [out.as_uri()]
    names = comparison.series_names()
    assert [alt for _, _, alt in images] == names == captions  # one figure per series
    assert all(complete and width > 0 for complete, width, _ in images)
    assert "chain reaches slow's final loss" not in text  # the page's table, not sentences
    assert all(str(runs[name]) in text for name in ("chain", "slow"))


def test_the_docs_commands_run_as_written(tmp_path):
    """docs/report.md's "Comparing runs" lines in a folder holding the shipped configs and a
    demo/file_list.txt of two small learnable corpora (the data quick start's tokenizer would
    take minutes): two runs at two learning rates, then their comparison."""
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    demo = tmp_path / "demo"
    demo.mkdir()
    for corpus, num_docs in (("code", 1500), ("docs", 1400)):  # not byte-identical copies
        write_counting_corpus(demo / "shards" / corpus, num_docs=num_docs)
    (demo / "file_list.txt").write_text("0.6 shards/code code\n0.4 shards/docs docs\n")
    text = (REPO / "docs" / "report.md").read_text()
    section = text[text.index("## Comparing runs") :]
    lines = command_lines(section[: section.index("\n## ", 1)], ("sh",))
    assert [line.split()[1] for line in lines] == ["train", "train", "report", "report"]
    bin_dir = str(Path(sys.executable).parent)
    env = outside_any_job(PATH=f"{bin_dir}:{outside_any_job()['PATH']}", OMP_NUM_THREADS="2")
    outputs = []
    for line in lines:
        result = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, f"{line}\n{result.stdout[-3000:]}\n{result.stderr}"
        outputs.append(result.stdout)
    shown = json.loads(outputs[-1])
    assert [run["label"] for run in shown["runs"]] == ["lr-1e-3", "lr-1e-2"]
    found = {(r["series"], r["run"]): r for r in shown["reaches"]}
    assert found["loss", "lr-1e-2"]["ratio"] > 1 and found["loss", "lr-1e-3"]["tokens"] is None
    assert "lr-1e-2 reaches lr-1e-3's final loss" in outputs[2]  # the --html run prints too
    assert {"loss", "heldout/code", "heldout/docs"} <= set(shown["runs"][0]["series"])
    assert (demo / "compare.html").read_text().count("<img") == 3
