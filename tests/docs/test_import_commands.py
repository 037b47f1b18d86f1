"""docs/checkpoints.md's Megatron and DeepSpeed import example, run as written in a fresh folder:
``megatron/``, ``megatron-lm/`` and ``deepspeed/`` hold checkpoints Megatron-core and DeepSpeed
wrote themselves (``goodput.testing.megatron_source``), ``model.toml`` their model and
``run.toml`` a short run of it; the venv's goodput is on PATH. Every import exits 0, and the
run resumes from the first and trains."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from goodput.launch.launchers import free_port
from goodput.testing import megatron_source
from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO, outside_any_job
from goodput.testing.tiny import write_random_corpus
from tests.unit.train.convert.test_megatron_import import GQA_UNTIED

SECTION = re.compile(r"^## Importing from Megatron and DeepSpeed\n(.*?)(?=^## |\Z)", re.S | re.M)


@pytest.mark.timeout(600)
def test_the_import_example_runs_as_written(tmp_path):
    match = SECTION.search((REPO / "docs" / "checkpoints.md").read_text())
    assert match is not None
    lines = command_lines(match[1], ("sh",))
    assert len(lines) == 4 and lines[-1].startswith("goodput train run.toml --resume RUN/")
    (tmp_path / "spec.json").write_text(json.dumps(GQA_UNTIED))
    for formats in ("torch_dist,legacy", "deepspeed"):
        argv = ["save", tmp_path / "spec.json", tmp_path / "saved", "--formats", formats]
        subprocess.run(
            [sys.executable, megatron_source.__file__, *map(str, argv), "--port", str(free_port())],
            check=True,
            capture_output=True,
        )
        for fmt, name in {"torch_dist": "megatron", "legacy": "megatron-lm"}.items():
            if (tmp_path / "saved" / fmt).is_dir() and not (tmp_path / name).exists():
                shutil.move(tmp_path / "saved" / fmt, tmp_path / name)
    shutil.move(tmp_path / "saved" / "deepspeed", tmp_path / "deepspeed")
    (tmp_path / "model.toml").write_text(megatron_source.model_toml(GQA_UNTIED))
    data = tmp_path / "data"
    data.mkdir()
    file_list = write_random_corpus(data, vocab_size=128, num_docs=100, lengths=(20, 90))
    run = [
        "[train]\nsteps = 2\ntokens_per_step = 128\nseq_len = 32\nmicro_batch_size = 4",
        'run_dir = "run"\n\n[data]',
        f'file_list = "{file_list}"\ncache = "cache"\n\n[parallel]\nprecision = "fp32"\n',
    ]
    (tmp_path / "run.toml").write_text((tmp_path / "model.toml").read_text() + "\n".join(run))
    bin_dir = str(Path(sys.executable).parent)
    env = outside_any_job(PATH=f"{bin_dir}:{outside_any_job()['PATH']}")
    for line in lines:
        result = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, f"{line}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        if line.startswith("goodput ckpt import"):
            assert "complete (model only)" in result.stdout
    assert "resume: from RUN/checkpoints/step-00000000" in result.stdout
    assert "step=2 " in result.stdout
