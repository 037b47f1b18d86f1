"""The commands the README and docs/ show: the README's quick starts run as written, and every
``goodput`` command line in a code block of the README or docs/ parses with the real parser
(most of those need a cluster, a GPU or a checkpoint to run; their features' own tests run
them, and test_recipe_commands.py runs each line that names a shipped recipe up to where the
hardware is needed)."""

import contextlib
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from goodput.cli import build_parser
from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO, outside_any_job

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
QUICK_START = re.compile(r"^## Quick start: (\w+)\n(.*?)(?=^## )", re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_goodput_command_line_parses(page):
    lines = [line for line in command_lines(page.read_text()) if line.startswith("goodput ")]
    for line in lines:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            try:
                build_parser().parse_args(shlex.split(line)[1:])
            except SystemExit as exit_:
                assert not exit_.code, f"{page.name}: {line}: {stderr.getvalue()}"


def test_the_readme_has_the_three_quick_starts():
    found = [name for name, _ in QUICK_START.findall((REPO / "README.md").read_text())]
    assert found == ["data", "train", "launch"]


@pytest.mark.timeout(900)  # tokenizer training, two short runs: about 2 min on 2 cores
def test_the_readme_quick_starts_run_as_written(tmp_path):
    """In a fresh folder holding the shipped configs, with the venv's goodput on PATH."""
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    bin_dir = str(Path(sys.executable).parent)
    env = outside_any_job(PATH=f"{bin_dir}:{outside_any_job()['PATH']}")
    outputs = {}
    for name, section in QUICK_START.findall((REPO / "README.md").read_text()):
        for line in command_lines(section):
            result = subprocess.run(
                ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True
            )
            assert result.returncode == 0, f"{name}: {line}\n{result.stdout}\n{result.stderr}"
            outputs[line] = result.stdout + result.stderr
    blend_dirs = list((tmp_path / "demo" / "cache" / "blends").iterdir())
    assert len(blend_dirs) == 1  # training on the quick-start blend was a cache hit
    verify = next(out for line, out in outputs.items() if line.startswith("goodput data verify"))
    assert verify.strip().endswith(": ok")
    for run in ("run-1", "run-2"):
        metrics = (tmp_path / "demo" / run / "metrics.jsonl").read_text().splitlines()
        losses = [json.loads(line)["loss"] for line in metrics]
        assert len(losses) == 40 and losses[-1] < losses[0] - 1
        # The last step's in-loop eval: the held-out samples of both corpora.
        evals = (tmp_path / "demo" / run / "evals.jsonl").read_text().splitlines()
        heldout = {(e["step"], e["task"]) for e in map(json.loads, evals) if e["metric"] == "loss"}
        assert heldout == {(40, "heldout/code"), (40, "heldout/docs")}
    listing = next(out for line, out in outputs.items() if line.startswith("goodput ckpt list"))
    assert "<- latest" in listing
    dry_run = next(out for line, out in outputs.items() if "--dry-run" in line)
    assert "goodput train configs/tiny-cpu.toml" in dry_run
    assert (tmp_path / "demo" / "run-2" / "attempts.jsonl").is_file()
    # docs/optimizers.md's example, on the quick starts' data: another optimizer trains too.
    lines = command_lines((REPO / "docs" / "optimizers.md").read_text())
    (line,) = [line for line in lines if line.startswith("goodput ")]
    result = subprocess.run(
        ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
    metrics = (tmp_path / "demo" / "run-mano" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(record)["loss"] for record in metrics]
    assert len(losses) == 40 and losses[-1] < losses[0] - 1
    # docs/evals.md's generate example: the quick start's run continues a prompt (its lm-eval
    # example runs in tests/e2e/test_eval_agreement.py, on local task files).
    lines = command_lines((REPO / "docs" / "evals.md").read_text())
    (line,) = [line for line in lines if line.startswith("goodput generate ")]
    result = subprocess.run(
        ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
    generated = json.loads(result.stdout)
    assert generated["prompt"] == "def main(" and generated["num_new_tokens"] <= 16
    assert generated["stopped"] in ("eod", "max_new_tokens")
