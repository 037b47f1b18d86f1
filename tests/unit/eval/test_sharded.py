"""``goodput eval`` and ``goodput generate`` sharded over the ranks of ``goodput launch``: the
same results as one process, bit for bit (real processes through the launcher); each rank holds
only its shards and a damaged checkpoint is refused on every rank; the compute dtype of the
checkpoint's precision policy."""

import json
import os
import re
import shlex
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from goodput import cli
from goodput.checkpoint.checksums import checkpoint_files, file_digests, write_checksums
from goodput.errors import GoodputError
from goodput.eval.inference import inference_dtype, load_for_inference
from goodput.eval.lm_eval_tasks import OFFLINE_VARIABLES
from goodput.testing.dist import run_distributed
from goodput.testing.doc_commands import command_lines
from goodput.testing.eval_tasks import (
    write_choice_task,
    write_generation_task,
    write_rolling_task,
)
from goodput.testing.jobs import REPO, run_goodput
from goodput.testing.tiny import tokenized_run_config
from goodput.train.convert.checkpoints import read_model_config
from goodput.train.loop import train
from goodput.train.setup import setup_torch

for _variable in OFFLINE_VARIABLES:  # before lm-eval (and datasets) are first imported
    os.environ.setdefault(_variable, "1")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# goodput launch starts `goodput` from PATH: this interpreter's.
ON_PATH = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run (fp32 policy) trained 8 steps with a real SentencePiece tokenizer."""
    root = tmp_path_factory.mktemp("sharded")
    cfg, _ = tokenized_run_config(root)
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, interval_steps=8, async_save=False))
    train(cfg)
    return root / "tiny" / "run"


def launched(tmp_path, *argv):
    """``goodput launch --nproc 2 -- goodput ARGV`` in ``tmp_path``; rank 0's stdout lines."""
    result = run_goodput(
        "launch", "--nproc", 2, "--", "goodput", *argv, cwd=tmp_path, env=ON_PATH, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return [line.removeprefix("[rank0] ") for line in result.stdout.splitlines()]


@pytest.mark.timeout(600)
def test_eval_on_two_ranks_writes_the_one_process_results(run, tmp_path):
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    files = [write_choice_task(tasks), write_rolling_task(tasks), write_generation_task(tasks)]
    common = ["eval", run, "--tasks", *files, "--json"]
    one = ["--output", tmp_path / "one.json", "--samples", tmp_path / "one.jsonl"]
    assert cli.main(list(map(str, [*common, *one]))) == 0  # one process: this one
    printed = launched(
        tmp_path, *common, "--output", tmp_path / "two.json", "--samples", tmp_path / "two.jsonl"
    )
    assert any("sharded over 2 ranks" in line for line in printed)
    # Every number: the tasks' metrics and each document's log-likelihoods and generations,
    # to float32 rounding (bit for bit where the CPU's matmul kernels round alike at one and
    # two threads per process; an AMD EPYC differed in one log-likelihood's last digit).
    for name in ("one.json", "one.jsonl"):
        two = tmp_path / name.replace("one", "two")
        assert _values(two) == _float32_approx(_values(tmp_path / name))
    summary = json.loads((tmp_path / "two.json").read_text())
    assert set(summary["results"]) == {"tiny_arc", "tiny_text", "tiny_generate"}
    assert summary["results"]["tiny_text"]["bits_per_byte"] > 0
    # Recorded in the run once per evaluation (rank 0 only), the same records.
    records = [{**json.loads(line), "time": None} for line in (run / "evals.jsonl").open()]
    assert len(records) == 12 and records[:6] == records[6:]


@pytest.mark.timeout(300)
def test_generate_on_two_ranks_gives_the_one_process_tokens(run, tmp_path, capsys):
    argv = ["generate", run, "--prompt", "alpha beta", "--max-new-tokens", 24, "--json"]
    assert cli.main(list(map(str, argv))) == 0  # one process: this one
    one = json.loads(capsys.readouterr().out)
    (line,) = [line for line in launched(tmp_path, *argv) if line.startswith("{")]
    assert json.loads(line) == one and one["num_new_tokens"] == 24


def load_on_rank(rank, world_size, step, damaged):
    runtime = setup_torch()
    model = load_for_inference(step, None, runtime).model
    shapes = {
        name: (tuple(p.shape), tuple(p.to_local().shape), p.dtype)
        for name, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    try:
        load_for_inference(damaged, None, runtime)
    except GoodputError as error:
        return shapes, error.render()
    return shapes, None


def test_each_rank_holds_its_half_and_a_damaged_checkpoint_is_refused_on_both(run, tmp_path):
    step = run / "checkpoints" / "step-00000008"
    damaged = tmp_path / "step-00000008"
    shutil.copytree(step, damaged)
    shard = next(damaged.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    ranks = run_distributed(load_on_rank, 2, step, damaged, timeout_s=180)
    cfg = read_model_config(step)
    num_tensors = 2 + 9 * cfg.num_layers + (not cfg.tie_embeddings)
    for shapes, refusal in ranks:
        assert len(shapes) == num_tensors  # every parameter sharded
        for full, local, dtype in shapes.values():
            assert local == (full[0] // 2, *full[1:]) and dtype == torch.float32
        assert refusal is not None and "refused:" in refusal and shard.name in refusal
    assert ranks[0][1] == ranks[1][1]


def with_precision(step: Path, out: Path, precision: str) -> Path:
    """A copy of ``step`` whose config says ``precision``, its checksums rewritten."""
    shutil.copytree(step, out)
    config = out / "config.toml"
    text = config.read_text()
    assert 'precision = "fp32"' in text
    config.write_text(text.replace('precision = "fp32"', f'precision = "{precision}"'))
    write_checksums(out, file_digests(out, checkpoint_files(out)))
    return out


@pytest.mark.parametrize("precision", ["fp32-master", "pure-bf16"])
def test_a_bf16_policy_runs_in_bf16_with_fp32_rotary_frequencies(run, tmp_path, precision):
    step = run / "checkpoints" / "step-00000008"
    copy = with_precision(step, tmp_path / "step-00000008", precision)
    assert (inference_dtype(step), inference_dtype(copy)) == (torch.float32, torch.bfloat16)
    full, half = (load_for_inference(path, None, None).model for path in (step, copy))
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in half.buffers()} == {torch.float32}
    for (name, a), (_, b) in zip(full.named_parameters(), half.named_parameters(), strict=True):
        assert torch.equal(a.bfloat16(), b), name  # the saved fp32 weights, rounded once
    tokens = torch.tensor([[5, 17, 3, 42, 8, 29, 11]])
    with torch.no_grad():
        expected, got = full(tokens), half(tokens).float()
    assert got.dtype == torch.float32 and not torch.equal(got, expected)
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.05)  # bf16's 8 bits


def test_the_docs_commands_for_a_large_checkpoint_launch_24_ranks():
    """docs/evals.md's 80B lines, as written but for --dry-run, in a stand-in Slurm job of two
    hosts: each starts its goodput command, unchanged, on 2 x 12 ranks."""
    (section,) = re.findall(
        r"^## A checkpoint of any size\n(.*?)(?=^## |\Z)",
        (REPO / "docs" / "evals.md").read_text(),
        re.S | re.M,
    )
    lines = command_lines(section, ("sh",))
    assert [line.split(" -- ")[1].split()[:2] for line in lines] == [
        ["goodput", "eval"],
        ["goodput", "generate"],
    ]
    job = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "x[1-2]", "SLURM_NNODES": "2"}
    for line in lines:
        argv = shlex.split(line.replace("goodput launch ", "goodput launch --dry-run ", 1))
        result = run_goodput(*argv[1:], env=job)
        assert result.returncode == 0, result.stderr
        (srun,) = result.stdout.splitlines()
        assert "srun --nodes 2 --ntasks 24 --ntasks-per-node 12" in srun
        assert srun.endswith(shlex.join(shlex.split(line.split(" -- ", 1)[1])))


@pytest.mark.parametrize("precision", ["fp64", "bf16"])
def test_a_checkpoint_with_an_unknown_precision_is_one_line(run, tmp_path, capsys, precision):
    copy = with_precision(
        run / "checkpoints" / "step-00000008", tmp_path / "step-00000008", precision
    )
    code = cli.main(["generate", str(copy), "--prompt", "alpha"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert f"config.toml: 'parallel.precision' = '{precision}' is not allowed" in err


def _values(path):
    """A ``--output`` (JSON) or ``--samples`` (JSON lines) file's values."""
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return [json.loads(line) for line in path.read_text().splitlines()]


def _float32_approx(value):
    """``value`` with every float as pytest.approx of float32 rounding (strings, counts and the
    structure exact)."""
    if isinstance(value, float):
        return pytest.approx(value, rel=1e-6, abs=1e-12)
    if isinstance(value, dict):
        return {key: _float32_approx(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_float32_approx(item) for item in value]
    return value
