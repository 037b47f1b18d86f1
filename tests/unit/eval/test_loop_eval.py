"""The loop's evaluation on a real run: held-out loss per corpus and a multiple-choice task every
``[eval] interval_steps``, to metrics, TensorBoard, the step log and evals.jsonl; the same
numbers in every layout; training unchanged by it; bad ``[eval]`` input refused up front."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from goodput.data.loader import BlendedSamples
from goodput.errors import GoodputError
from goodput.eval.config import EvalConfig
from goodput.eval.inference import load_for_inference
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import tokenized_run_config, write_spelling_task
from goodput.train.loop import train
from goodput.train.loss import token_loss_sum


def with_eval(cfg, **changes):
    return replace(cfg, eval=EvalConfig(**changes))


@pytest.fixture
def eval_run(tmp_path):
    cfg, _ = tokenized_run_config(tmp_path)
    task = write_spelling_task(tmp_path / "spelling.jsonl")
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, interval_steps=4))
    return with_eval(cfg, interval_steps=4, holdout_samples=4, tasks=(f"hellaswag:{task}",))


def records(cfg, name="metrics.jsonl"):
    text = (Path(cfg.train.run_dir) / name).read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_the_loop_evaluates_every_interval(eval_run, capsys):
    train(eval_run)
    out = capsys.readouterr().out
    assert (
        "train: eval every 4 steps: 4 held-out samples of 1 corpus(es), spelling (10 items)" in out
    )
    eval_lines = [line for line in out.splitlines() if line.startswith("eval: step ")]
    assert [line.split(":")[1] for line in eval_lines] == [" step 4", " step 8"]
    assert "held-out loss" in eval_lines[0] and "spelling acc" in eval_lines[0]
    by_step = {r["step"]: r for r in records(eval_run)}
    for step in (4, 8):
        record = by_step[step]
        assert record["heldout_loss"] == record["heldout_loss/docs"] > 0
        assert record["heldout_ppl"] == pytest.approx(math.exp(record["heldout_loss"]))
        assert 0 <= record["acc/spelling"] <= 1 and record["eval_time_s"] > 0
    assert "heldout_loss" not in by_step[3] and "eval_alarm" not in by_step[8]
    assert by_step[8]["heldout_loss"] < by_step[4]["heldout_loss"]  # it is learning
    evals = records(eval_run, "evals.jsonl")
    assert {(e["step"], e["task"], e["metric"]) for e in evals} == {
        (step, task, metric)
        for step in (4, 8)
        for task, metric in [
            ("heldout/docs", "loss"),
            ("heldout/docs", "perplexity"),
            ("spelling", "acc"),
            ("spelling", "acc_norm"),
            ("spelling", "chance"),
        ]
    }
    acc = next(e for e in evals if (e["step"], e["task"], e["metric"]) == (8, "spelling", "acc"))
    assert acc["source"] == "train" and acc["value"] == by_step[8]["acc/spelling"]
    assert acc["stderr"] == pytest.approx(math.sqrt(acc["value"] * (1 - acc["value"]) / 9))


def test_tensorboard_carries_the_eval(eval_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(eval_run)
    events = EventAccumulator(str(Path(eval_run.train.run_dir) / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/heldout_loss/docs")]
    by_step = {r["step"]: r for r in records(eval_run)}
    assert logged == [(s, pytest.approx(by_step[s]["heldout_loss"], rel=1e-6)) for s in (4, 8)]


def test_the_heldout_loss_is_the_checkpoint_models_mean_token_loss(eval_run):
    """Recomputed from the step-8 checkpoint, sample by sample, outside the loop."""
    train(eval_run)
    run_dir = Path(eval_run.train.run_dir)
    logged = {r["step"]: r for r in records(eval_run)}[8]["heldout_loss"]
    model = load_for_inference(run_dir, None, None).model
    blend = json.loads((run_dir / "run.json").read_text())["data"]["fingerprint"]
    samples = BlendedSamples(Path(eval_run.data.cache) / "blends" / blend[:20])
    total, tokens = 0.0, 0
    with torch.no_grad():
        for k in range(4):
            sample = torch.from_numpy(samples.heldout(0, k))[None]
            total += float(token_loss_sum(model(sample[:, :-1]), sample[:, 1:]))
            tokens += sample.shape[1] - 1
    assert logged == pytest.approx(total / tokens, rel=1e-5)


def test_evals_do_not_change_training(eval_run, tmp_path):
    with_evals = train(eval_run)
    quiet = replace(
        with_eval(eval_run, holdout_samples=4),
        train=replace(eval_run.train, run_dir=str(tmp_path / "q")),
    )
    assert train(quiet) == with_evals  # bit for bit: no RNG, weight or optimizer state moved


def train_on_rank(rank, world_size, cfg):
    return train(cfg)


@pytest.mark.parametrize(
    "layout",
    [
        {"data_parallel": "fsdp"},
        {"tp": 2},
        {"pp": 2},
        {"cp": 2},
        # A V of 4 stages (4 layers), whose eval runs the schedule's forwards only.
        {"pp": 2, "pp_schedule": "dualpipev"},
    ],
    ids=["fsdp2", "tp2", "pp2", "cp2", "pp2-dualpipev"],
)
def test_every_layout_evaluates_the_same(eval_run, tmp_path, layout):
    stages = replace(eval_run.parallel, **layout).num_stages
    eval_run = replace(
        eval_run, model=replace(eval_run.model, num_layers=max(eval_run.model.num_layers, stages))
    )
    train(eval_run)
    reference = records(eval_run, "evals.jsonl")
    cfg = replace(
        eval_run,
        train=replace(eval_run.train, run_dir=str(tmp_path / "layout")),
        parallel=replace(eval_run.parallel, **layout),
    )
    run_distributed(train_on_rank, 2, cfg)
    now = records(cfg, "evals.jsonl")
    assert [(e["step"], e["task"], e["metric"]) for e in now] == [
        (e["step"], e["task"], e["metric"]) for e in reference
    ]
    for old, new in zip(reference, now, strict=True):
        assert new["value"] == pytest.approx(old["value"], rel=1e-4), (old, new)


def test_bad_eval_config_is_one_line_before_anything_is_written(eval_run, tmp_path):
    missing = with_eval(eval_run, interval_steps=4, tasks=(f"hellaswag:{tmp_path}/none.jsonl",))
    with pytest.raises(GoodputError, match="none.jsonl"):
        train(missing)
    assert not Path(eval_run.train.run_dir).exists()
    for changes, message in [
        ({"interval_steps": 4}, "nothing to evaluate"),
        ({"tasks": ("arc:x.jsonl",)}, "need in-loop evals"),
        ({"interval_steps": 1, "tasks": ("mmlu:x.jsonl",)}, "is not LAYOUT:PATH"),
        ({"interval_steps": 1, "tasks": ("arc:a/x.jsonl", "piqa:b/x.jsonl")}, "a second task"),
    ]:
        with pytest.raises(GoodputError, match=message):
            EvalConfig(**changes)


def test_holding_out_more_than_a_corpus_holds_is_refused(eval_run):
    with pytest.raises(GoodputError, match="leaves none to train on"):
        train(with_eval(eval_run, interval_steps=4, holdout_samples=100_000))
