"""Three harnesses, one number: on the same local ARC-like task file and the same trained tiny
checkpoint, goodput's own harness (``score_choices``), lm-eval's evaluator through ``goodput
eval`` and lm-eval's ``hf`` model on the ``goodput ckpt export-hf`` folder give the same per-item
log-likelihoods (within ``TOLERANCE``) and the same acc and acc_norm; rolling log-likelihoods
agree with ``hf`` too. And docs/evals.md's lm-eval example runs as written, in one process and as
two ranks under ``goodput launch``, with the same result."""

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from goodput import cli
from goodput.eval.choice_tasks import read_choice_task
from goodput.eval.harness import score_choices
from goodput.eval.inference import load_for_inference
from goodput.eval.lm_eval_tasks import OFFLINE_VARIABLES, load_tasks, resolve_tasks, run_tasks
from goodput.testing.doc_commands import command_lines
from goodput.testing.eval_tasks import write_choice_task, write_rolling_task
from goodput.testing.jobs import REPO, outside_any_job
from goodput.testing.tiny import tokenized_run_config
from goodput.train.loop import train

for _variable in OFFLINE_VARIABLES:  # before lm-eval (and datasets) are first imported
    os.environ.setdefault(_variable, "1")
pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOLERANCE = 1e-4  # absolute, per summed log-likelihood; the CPU fp32 runs differ by ~1e-6
SECTION = re.compile(r"^## lm-eval tasks on a checkpoint\n(.*?)(?=^## |\Z)", re.S | re.M)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run trained 8 steps with a real SentencePiece tokenizer, its HF export, and the
    task files: 40 ARC-like items (every tenth past the model's 64 positions) and documents."""
    root = tmp_path_factory.mktemp("agreement")
    cfg, tokenizer = tokenized_run_config(root)
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, interval_steps=8, async_save=False))
    train(cfg)
    run_dir = root / "tiny" / "run"
    step = run_dir / "checkpoints" / "step-00000008"
    hf = root / "hf"
    assert cli.main(["ckpt", "export-hf", str(step), str(hf)]) == 0
    return {
        "run": run_dir,
        "step": step,
        "hf": hf,
        "tokenizer": tokenizer,
        "choice": write_choice_task(root / "tasks"),
        "rolling": write_rolling_task(root / "tasks"),
    }


def goodput_eval(*argv, cwd=None, env=None):
    result = subprocess.run(
        [sys.executable, "-m", "goodput", "eval", *map(str, argv)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result


def samples_of(path: Path) -> dict[str, list[dict]]:
    samples: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        samples.setdefault(record["task"], []).append(record)
    return {task: sorted(records, key=lambda r: r["doc_id"]) for task, records in samples.items()}


def hf_results(trained, *task_files):
    """lm-eval's own ``hf`` model on the export, fp32 on the CPU, run by the same evaluator
    call as goodput's. Its loglikelihood prefix is the end-of-document token goodput trains
    after (``hf`` otherwise prefixes BOS, which a goodput model never saw)."""
    from lm_eval.models.huggingface import HFLM

    eod_id = load_for_inference(trained["step"], None, None).tokenizer.eod_id
    lm = HFLM(
        pretrained=str(trained["hf"]),
        dtype="float32",
        device="cpu",
        batch_size=16,
        prefix_token_id=eod_id,
    )
    tasks = resolve_tasks([str(path) for path in task_files])
    results = run_tasks(lm, load_tasks(tasks), log_samples=True)
    assert results is not None
    samples = {
        task: sorted(records, key=lambda r: r["doc_id"])
        for task, records in results["samples"].items()
    }
    return results, samples


def test_harness_goodput_eval_and_hf_agree_item_by_item(trained, tmp_path):
    # (a) goodput's harness over choice_tasks' reading of the same JSONL.
    items = read_choice_task(trained["choice"].with_suffix(".jsonl"), "arc")
    loaded = load_for_inference(trained["step"], None, None)
    harness = score_choices(loaded.model, loaded.tokenizer, items, device="cpu", max_len=64)
    # (b) lm-eval through goodput eval, its per-document responses logged.
    samples_file = tmp_path / "samples.jsonl"
    out = goodput_eval(
        trained["run"], "--tasks", trained["choice"], "--json", "--samples", samples_file
    )
    summary = json.loads(out.stdout)["results"]["tiny_arc"]
    ours = samples_of(samples_file)["tiny_arc"]
    # (c) lm-eval's hf model on the export.
    results, theirs = hf_results(trained, trained["choice"])
    hf_summary = results["results"]["tiny_arc"]
    assert len(ours) == len(theirs["tiny_arc"]) == len(items) == 40
    worst = 0.0
    for index, (item, mine, hf) in enumerate(zip(items, ours, theirs["tiny_arc"], strict=True)):
        assert mine["doc_id"] == hf["doc_id"] == index
        goodput_lls = [ll for ll, _ in mine["filtered_resps"]]
        hf_lls = [ll for ll, _ in hf["filtered_resps"]]
        assert len(goodput_lls) == len(item.choices)
        assert goodput_lls == pytest.approx(harness.loglikelihoods[index], abs=TOLERANCE)
        assert goodput_lls == pytest.approx(hf_lls, abs=TOLERANCE)
        assert mine["target"] == item.answer
        # is_greedy agrees too, and each document's 0/1 outcomes.
        assert [g for _, g in mine["filtered_resps"]] == [g for _, g in hf["filtered_resps"]]
        assert mine["metrics"] == {"acc": hf["acc"], "acc_norm": hf["acc_norm"]}
        worst = max(worst, *(abs(a - b) for a, b in zip(goodput_lls, hf_lls, strict=True)))
    assert worst < TOLERANCE
    for metric in ("acc", "acc_norm"):
        assert summary[metric] == getattr(harness, metric) == hf_summary[f"{metric},none"]
        stderr = getattr(harness, f"{metric}_stderr")
        assert summary[f"{metric}_stderr"] == pytest.approx(stderr)
        assert hf_summary[f"{metric}_stderr,none"] == pytest.approx(stderr)
    # The long questions really were cut from the left (else the test shows nothing of it).
    longest = max(len(loaded.tokenizer.encode_batch([item.context])[0]) for item in items)
    assert longest > 64


def test_rolling_loglikelihoods_agree_with_hf(trained, tmp_path):
    samples_file = tmp_path / "samples.jsonl"
    goodput_eval(trained["step"], "--tasks", trained["rolling"], "--samples", samples_file)
    ours = samples_of(samples_file)["tiny_text"]
    results, theirs = hf_results(trained, trained["rolling"])
    for mine, hf in zip(ours, theirs["tiny_text"], strict=True):
        assert mine["filtered_resps"][0] == pytest.approx(hf["filtered_resps"][0], abs=TOLERANCE)


def docs_example() -> tuple[dict[str, str], list[str]]:
    """docs/evals.md's lm-eval section: its files (a fenced block right after a line naming
    the file in backquotes) and its command lines."""
    (section,) = SECTION.findall((REPO / "docs" / "evals.md").read_text())
    files = dict(
        re.findall(r"`([\w/.-]+\.(?:yaml|jsonl))`[^\n]*:\n\n```\w*\n(.*?)```", section, re.S)
    )
    return files, command_lines(section, ("sh",))


@pytest.mark.timeout(600)
def test_the_docs_example_runs_as_written_in_one_process_and_on_two_ranks(trained, tmp_path):
    files, commands = docs_example()
    assert set(files) == {"tasks/arc_tiny.yaml", "tasks/arc_tiny.jsonl"}
    assert commands and all(line.startswith("goodput ") for line in commands)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "run-1").symlink_to(trained["run"])  # the README quick start's run
    bin_dir = str(Path(sys.executable).parent)
    env = outside_any_job(PATH=f"{bin_dir}:{outside_any_job()['PATH']}")
    evals = trained["run"] / "evals.jsonl"
    summaries = []
    for line in commands:
        before = len(evals.read_text().splitlines()) if evals.exists() else 0
        result = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
        # goodput launch prefixes each rank's lines; rank 0 prints the result.
        (printed,) = [
            text.removeprefix("[rank0] ")
            for text in result.stdout.splitlines()
            if text.removeprefix("[rank0] ").startswith('{"results"')
        ]
        summaries.append(json.loads(printed))
        added = evals.read_text().splitlines()[before:]
        assert {json.loads(record)["task"] for record in added} == {"arc_tiny"}
        assert len(added) == 2  # acc and acc_norm, once: by rank 0 only
    assert len(summaries) == 2 and any("launch --nproc 2" in line for line in commands)
    single, ranks = summaries
    assert single["step"] == ranks["step"] == 8
    arc, arc_ranks = single["results"]["arc_tiny"], ranks["results"]["arc_tiny"]
    assert set(arc) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert arc_ranks == arc  # the model sharded over two ranks: bit for bit
