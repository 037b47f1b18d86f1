"""The pipeline as a user runs it: `python -m goodput.demo` and the CLI in real processes."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from goodput.chaos.campaign import MIN_IDLE_TIMEOUT_S
from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO, outside_any_job

CONFIGS = Path(__file__).parents[2] / "configs"


def goodput(*args, env=None, check=True):
    result = subprocess.run(
        [sys.executable, "-m", "goodput.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    result = subprocess.run(
        [sys.executable, "-m", "goodput.demo", "--output", str(out), "--train-steps", "40"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return out, result.stdout


def test_demo_runs_every_stage_and_reports_the_mixture(demo):
    out, stdout = demo
    for command in ("demo-corpus", "train-tokenizer", "tokenize", "inspect", "blend", "verify"):
        assert f"$ goodput data {command}" in stdout
    assert "target  achieved" in stdout  # (40 steps read too little to repeat a corpus)
    assert "blend.json: ok" in stdout and "first global batch: input_ids (8, 128)" in stdout
    for domain in ("code", "docs", "docstrings"):
        manifest = json.loads((out / "shards" / f"{domain}.manifest.json").read_text())
        assert manifest["num_documents"] > 50 and manifest["dtype"] == "uint16"


def test_demo_trains_on_two_ranks_and_the_loss_falls(demo):
    out, stdout = demo
    assert "$ goodput launch --nproc 2 --run-dir" in stdout and "-- goodput train" in stdout
    assert "[rank0] step=1 " in stdout  # rank 0 speaks for the run, prefixed by the launcher
    metrics = [
        json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == list(range(1, 41))
    assert abs(metrics[0]["loss"] - math.log(4096)) < 0.3
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 1.0 and "loss fell from" in stdout
    run = json.loads((out / "run" / "run.json").read_text())
    # The trainer asked for the blend the demo built: same content, same directory.
    assert run["world_size"] == 2 and f"[rank0] blend {run['data']['blend']}\n" in stdout
    attempts = (out / "run" / "attempts.jsonl").read_text().splitlines()
    assert len(attempts) == 1 and json.loads(attempts[0])["exit_code"] == 0


def test_demo_ends_with_its_eval(demo):
    """Held-out loss per corpus and the shipped multiple-choice task, at the last step, printed;
    a learning run: the task is above chance and the gate stays quiet."""
    out, stdout = demo
    assert "[rank0] eval: step 40: held-out loss " in stdout and "eval gate" not in stdout
    assert stdout.rstrip().endswith(f"report: {out / 'report.html'}")  # the demo's last line
    block = stdout[stdout.index("eval at step 40 (") :].split("\n\n")[0]
    tasks = [line.split()[0] for line in block.splitlines()[1:]]
    assert tasks == ["heldout/code", "heldout/docstrings", "heldout/docs", "python_spelling"]
    evals = [json.loads(line) for line in (out / "run" / "evals.jsonl").read_text().splitlines()]
    acc = next(e for e in evals if e["task"] == "python_spelling" and e["metric"] == "acc")
    assert acc["step"] == 40 and acc["value"] > 0.25 + 2 * acc["stderr"]
    heldout = [
        e["value"] for e in evals if e["task"].startswith("heldout/") and e["metric"] == "loss"
    ]
    assert len(heldout) == 3 and all(loss < metrics_loss(out, 1) for loss in heldout)


def metrics_loss(out, step):
    records = (out / "run" / "metrics.jsonl").read_text().splitlines()
    return json.loads(records[step - 1])["loss"]


def test_train_refuses_a_vocabulary_smaller_than_the_tokenizers(demo, tmp_path):
    out, _ = demo
    result = goodput(
        "train",
        CONFIGS / "tiny-cpu.toml",
        "model.vocab_size=1000",
        f"data.file_list={out / 'file_list.txt'}",
        f"data.cache={out / 'cache'}",
        f"train.run_dir={tmp_path / 'run'}",
        check=False,
    )
    assert result.returncode == 2
    assert "tokenizer's vocabulary (4096) is larger than model.vocab_size (1000)" in result.stderr
    assert not (tmp_path / "run").exists()


def test_verify_names_a_changed_shard(demo, tmp_path):
    out, _ = demo
    blend_dir = next(p for p in (out / "cache" / "blends").iterdir() if p.is_dir())
    shard = out / "shards" / "docs_00000.bin"
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[:10] + bytes([original[10] ^ 1]) + original[11:])
        result = goodput("data", "verify", blend_dir, check=False)
        assert result.returncode == 1
        assert f"{shard}: checksum mismatch" in result.stderr and "FAILED" in result.stdout
    finally:
        shard.write_bytes(original)
    assert goodput("data", "verify", blend_dir).returncode == 0


def test_ranks_from_the_launcher_environment_split_the_work(demo, tmp_path):
    out, _ = demo
    corpus, tokenizer = out / "corpus", out / "tokenizer.model"
    argv = [
        sys.executable,
        "-m",
        "goodput.cli",
        "data",
        "tokenize",
        str(corpus),
        "--tokenizer",
        str(tokenizer),
        "--output",
        str(tmp_path / "ranked"),
        "--name",
        "all",
        "--shard-size-mb",
        "1",
        "--workers",
        "1",
    ]
    ranks = [
        subprocess.Popen(
            argv,
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    goodput(
        "data",
        "tokenize",
        corpus,
        "--tokenizer",
        tokenizer,
        "--output",
        tmp_path / "single",
        "--name",
        "all",
        "--shard-size-mb",
        "1",
        "--workers",
        "2",
    )
    ranked = json.loads((tmp_path / "ranked" / "all.manifest.json").read_text())
    single = json.loads((tmp_path / "single" / "all.manifest.json").read_text())
    assert len(ranked["shards"]) == 2  # code alone; docs + docstrings share a unit
    assert ranked["shards"] == single["shards"] and ranked["job_key"] == single["job_key"]


def test_verify_names_a_changed_tokenizer(demo):
    out, _ = demo
    blend_dir = next(p for p in (out / "cache" / "blends").iterdir() if p.is_dir())
    tokenizer = out / "tokenizer.model"
    original = tokenizer.read_bytes()
    try:
        tokenizer.write_bytes(original + b"\0")
        result = goodput("data", "verify", blend_dir, check=False)
        assert result.returncode == 1
        assert f"{tokenizer}: tokenizer file changed since it was pinned" in result.stderr
    finally:
        tokenizer.write_bytes(original)


# The demo model (tied embeddings, fp32) on 4 ranks through goodput launch, as the docs tell a
# user to: `goodput launch --nproc 4 -- goodput train CONFIG parallel.*=...`; its
# mixture-of-experts variant (model.moe.*) too. Every layout's numbers against one process are
# tests/unit/train/test_layout_invariance.py's (tied and untied, one process group); here one
# layout per kind of split the launcher's ranks must agree on: sharded and replicated data,
# tensor with pipeline, context with tensor, experts beside tensor parallelism.
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]
LAYOUTS = {
    "dp_shard=4": [],
    "tp=2 x pp=2, gpipe": ["parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "cp=2 x tp=2": ["parallel.cp=2", "parallel.tp=2"],
    "moe dp_shard=4": MOE,
    "moe ep=2 x tp=2": [*MOE, "parallel.ep=2", "parallel.tp=2"],
}


@pytest.mark.timeout(900)
def test_the_demo_model_trains_alike_in_each_kind_of_layout_through_goodput_launch(demo, tmp_path):
    out, _ = demo
    curves = {}
    for name, overrides in LAYOUTS.items():
        run_dir = tmp_path / name.replace(" ", "").replace(",", "-")
        goodput(
            "launch",
            "--nproc",
            4,
            "--run-dir",
            run_dir,
            "--",
            sys.executable,
            "-m",
            "goodput.cli",
            "train",
            CONFIGS / "tiny-cpu.toml",
            "train.steps=3",
            f"train.run_dir={run_dir}",
            f"data.file_list={out / 'file_list.txt'}",
            f"data.cache={out / 'cache'}",
            "checkpoint.interval_steps=0",  # no save: what is compared is the curve
            *overrides,
        )
        metrics = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        # The last step's in-loop eval (held-out loss per corpus) too: every layout evaluates.
        last = metrics[-1]
        heldout = [last[f"heldout_loss/{corpus}"] for corpus in ("code", "docstrings", "docs")]
        curves[name] = [m[key] for m in metrics for key in ("loss", "grad_norm")] + heldout
    references = {"dense": curves.pop("dp_shard=4"), "moe": curves.pop("moe dp_shard=4")}
    for reference in references.values():
        assert len(reference) == 9 and abs(reference[0] - math.log(4096)) < 0.3
    for name, curve in curves.items():  # fp32: equal but for the order of the sums
        reference = references["moe" if name.startswith("moe") else "dense"]
        assert curve == pytest.approx(reference, rel=1e-4), name


@pytest.mark.timeout(900)
def test_the_walkthroughs_failure_and_report_run_as_written(demo, tmp_path):
    """docs/walkthrough.md's sections 4 and 5 on the demo's data, in a folder holding the
    shipped configs, as a user types them (the venv's goodput on PATH): a real faulted run (a
    rank killed, a rank stopped until the watchdog fires), and the report of it, which is the
    campaign's own account of the same files, figure for figure."""
    out, _ = demo
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    (tmp_path / "demo").symlink_to(out)
    text = (REPO / "docs" / "walkthrough.md").read_text()
    lines = command_lines(text[text.index("## 4.") :])
    assert [line.split()[1] for line in lines] == ["chaos", "report", "report"]
    bin_dir = str(Path(sys.executable).parent)
    env = outside_any_job(PATH=f"{bin_dir}:{outside_any_job()['PATH']}")
    outputs = []
    for line in lines:
        result = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, f"{line}\n{result.stdout[-3000:]}\n{result.stderr}"
        outputs.append(result.stdout)
    assert "bitwise equal" in outputs[0]
    report = json.loads(outputs[2])
    assert report == json.loads((out / "chaos" / "report.json").read_text())["goodput"]["faulted"]
    assert f"goodput {report['goodput']:.1%} " in outputs[0]  # as goodput report prints it
    classes = [attempt["class"] for attempt in report["attempts"]]
    assert classes[-1] == "success" and "hang" in classes and len(classes) == 3
    assert report["steps"]["done"] and report["steps"]["kept"] == 30
    assert report["steps"]["recomputed"] > 0 and report["badput_s"]["recomputed"] > 0
    # The stopped rank, until the watchdog fired: the idle timeout chaos derives from the
    # straight run (no --timeout on the line), at least its floor, and said so.
    assert report["badput_s"]["hang"] > 0
    campaign = json.loads((out / "chaos" / "report.json").read_text())
    (hang,) = [fault for fault in campaign["faults"] if fault["kind"] == "hang"]
    assert hang["detection_s"] >= campaign["idle_timeout_s"] >= MIN_IDLE_TIMEOUT_S
    derived = f"idle timeout {campaign['idle_timeout_s']:.1f} s for the faulted run: "
    assert any(note.startswith(derived) for note in campaign["notes"])
    total = report["productive_s"] + sum(report["badput_s"].values())
    assert total == pytest.approx(report["wall_s"], rel=1e-6) and 0 < report["goodput"] < 1
    page = (out / "chaos-report.html").read_bytes()
    assert len(page) > 10_000 and page.count(b"<img") >= 5


def test_the_report_pages_commands_run_as_written(demo, tmp_path):
    """docs/report.md's commands on the demo's run (done, so --watch draws once and ends)."""
    out, _ = demo
    (tmp_path / "demo").symlink_to(out)
    text = (REPO / "docs" / "report.md").read_text()
    lines = command_lines(text[: text.index("## Goodput and badput")])
    assert [line.split()[-1] for line in lines] == [
        "demo/run", "demo/report.html", "--json", "--watch"
    ]  # fmt: skip
    bin_dir = str(Path(sys.executable).parent)
    env = outside_any_job(PATH=f"{bin_dir}:{outside_any_job()['PATH']}")
    for line in lines:
        result = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
        if line.endswith("--json"):
            report = json.loads(result.stdout)
            assert report["steps"]["done"] and report["steps"]["kept"] == 40
            assert 0 < report["goodput"] <= 1
        else:
            assert "where the wall time went" in result.stdout
    assert (out / "report.html").stat().st_size > 10_000
