"""The non-finite guard on two real gloo ranks: a NaN put into one rank's gradients (the ``nan``
fault) reaches every rank through the gradient reduction, every rank skips that optimizer step,
the metrics count it, and a run resumed across skipped steps ends bit-identical to a straight
one — weights, optimizer state, generators, losses and the skip count."""

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from goodput.rundir import checkpoints_dir, rng_file, step_dir
from goodput.testing.dist import run_distributed
from goodput.train.loop import train

NAN_STEPS = (3, 6)


def train_on_rank(rank, world_size, cfg):
    return train(cfg)


def saved_tensors(directory, tmp_path):
    out = tmp_path / f"{directory.parent.parent.name}.pt"
    dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=True)


def flatten(tree, prefix=""):
    """{"model.output.weight": tensor, "optim.output.weight.exp_avg": tensor, ...}"""
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for key, sub in tree.items() for k, v in flatten(sub, f"{prefix}{key}.").items()}


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_nan_gradients_skip_the_step_on_every_rank_and_a_resume_stays_bit_exact(
    run_config, tmp_path, monkeypatch, capfd
):
    plan = tmp_path / "plan.json"
    faults = [{"id": i, "kind": "nan", "step": s, "rank": 1} for i, s in enumerate(NAN_STEPS)]
    plan.write_text(json.dumps({"fired_dir": str(tmp_path / "fired"), "faults": faults}))
    monkeypatch.setenv("GOODPUT_FAULTS", str(plan))  # the ranks are spawned with it

    def run(name, **checkpoint):
        cfg = replace(
            run_config,
            train=replace(run_config.train, run_dir=str(tmp_path / name)),
            checkpoint=replace(run_config.checkpoint, interval_steps=4, **checkpoint),
        )
        losses = run_distributed(train_on_rank, 2, cfg)
        assert losses[0] == losses[1]
        return losses[0], cfg.train.run_dir

    straight, straight_dir = run("straight")
    records = metrics(straight_dir)
    assert [(r["skipped"], r["skipped_steps"]) for r in records] == [
        (False, 0),
        (False, 0),
        (True, 1),
        (False, 1),
        (False, 1),
        (True, 2),
        (False, 2),
        (False, 2),
    ]
    assert [r["grad_norm"] is None for r in records] == [r["skipped"] for r in records]
    out = capfd.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if "SKIPPED" in line] == [
        "step=3",
        "step=6",
    ]
    straight_root = checkpoints_dir(straight_dir)
    final = saved_tensors(step_dir(straight_root, 8), tmp_path)
    # Adam stepped on 6 of 8 steps: the skipped ones left its state alone.
    assert {int(state["step"]) for state in final["optim"].values()} == {8 - len(NAN_STEPS)}

    resumed, resumed_dir = run("resumed", resume=str(step_dir(straight_root, 4)))
    assert resumed == straight[4:]  # exactly, step for step
    keys = ("step", "loss", "grad_norm", "skipped", "skipped_steps")
    assert [{k: r[k] for k in keys} for r in metrics(resumed_dir)] == [
        {k: r[k] for k in keys} for r in records[4:]
    ]
    resumed_root = checkpoints_dir(resumed_dir)
    again = saved_tensors(step_dir(resumed_root, 8), tmp_path)
    assert flatten(final).keys() == flatten(again).keys()
    for key, tensor in flatten(final).items():
        assert torch.equal(tensor, flatten(again)[key]), key
    for rank in (0, 1):
        assert rng_file(step_dir(resumed_root, 8), rank).read_text() == (
            rng_file(step_dir(straight_root, 8), rank).read_text()
        )
    state = json.loads((step_dir(resumed_root, 8) / "train_state.json").read_text())
    assert (state["skipped_steps"], state["skipped_in_a_row"]) == (2, 0)
