"""``goodput plan layout --verify`` of a config of data-mix stages (one starting by tokens) with
the wsd decay tied to a stage: the build it verifies never reads the data, so the stages and the
decay tied to them give way to the placeholder file list, and the plan's own batch (which
need not divide a stage's start_tokens) is what the build takes."""

from __future__ import annotations

import subprocess
import sys

from goodput.config import load_config
from goodput.plan.verify import PLACEHOLDER_FILE_LIST, run_config
from goodput.testing.jobs import outside_any_job
from goodput.testing.stages import TINY_CPU
from goodput.train.config.parallel import ParallelConfig
from goodput.train.config.run import RunConfig

STAGES = """[data]
cache = "c"
[[data.stages]]
file_list = "web.txt"
start_step = 0
[[data.stages]]
file_list = "anneal.txt"
start_tokens = 409600
"""


def staged_tiny_cpu(folder):
    """tiny-cpu.toml with two stages, the second from 409,600 tokens (step 100 of its batch),
    and its decay from that stage."""
    text = TINY_CPU.read_text()
    start = text.index("[data]")
    text = text[:start] + STAGES + text[text.index("\n[", start + 1) :]
    text = text.replace('kind = "warmup_cosine"', 'kind = "wsd"\ndecay_start = "stage:1"')
    path = folder / "staged.toml"
    path.write_text(text)
    return path


def test_the_verified_config_takes_the_placeholder_for_the_stages(tmp_path):
    path = staged_tiny_cpu(tmp_path)
    model = load_config(RunConfig, path).model
    parallel = ParallelConfig(precision="fp32")
    cfg = run_config(path, model, parallel, seq_len=128, micro_batch_size=3, global_batch_size=6)
    assert cfg.data.file_list == PLACEHOLDER_FILE_LIST and cfg.data.stages is None
    assert cfg.schedule.kind == "wsd" and cfg.schedule.decay_start is None
    assert cfg.train.tokens_per_step == 6 * 128  # 409,600 is no multiple of it


def test_plan_layout_verify_runs_on_a_staged_config(tmp_path):
    path = staged_tiny_cpu(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "goodput", "plan", "layout", str(path), "--nhosts", "1",
         "--ppn", "2", "--gpu-mem-gb", "16", "--verify"],
        capture_output=True, text=True, env=outside_any_job(), timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "verified on this CPU under a fake process group of 2 ranks" in result.stdout
    assert "agree" in result.stdout  # the build's state per device against the estimate
