"""Checkpoints across parallel layouts, through the real loop on gloo ranks.

A run saved at step 3 under one layout, rerun to step 6 in the same run directory under another,
resumes from step 3 and records every step's loss as a straight run on one rank does: model,
optimizer state and loader position all carried across (the loss of step 4 shows the model and
the loader position; steps 5 and 6 the optimizer state too). A save that fails on the last
pipeline stage's ranks only is not complete. The HF export of a checkpoint saved under tp x pp
equals the export of the same training on one rank.

Every 4-rank run of the module happens in one spawned group (``layout_runs``), one
``train()`` after another: starting 4 interpreters costs more than a tiny run.
"""

import contextlib
import io
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from goodput.cli import main
from goodput.rundir import LATEST, METRICS, checkpoints_dir, list_checkpoints, step_dir
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import tiny_run_config
from goodput.train.config.model import MoEConfig
from goodput.train.config.run import RunConfig
from goodput.train.loop import train

pytestmark = pytest.mark.timeout(900)  # the module's runs, paid by its first test

# fp32, yet not exact: a layout computes the same sums in another order (sharded,
# tensor-parallel and pipelined reductions, other micro-batch groupings), so losses differ by a
# few ulps (seen: at most 4.8e-7); a lost optimizer state or loader position moves them by more
# than 4e-3.
LOSS_TOLERANCE = 1e-5
# Weights after 3 AdamW steps at lr 1e-2: Adam divides each gradient by its root mean square,
# so where a gradient is nearly zero its rounding error is a sizeable part of the update (seen:
# at most 3.5e-6); a weight taken from the wrong shard or stage is off by ~1e-2.
WEIGHT_TOLERANCE = 1e-4
STEPS, SAVED_AT = 6, 3

# (save layout, load layout) as [parallel] overrides, and the model: tied or untied embeddings,
# or a mixture of experts (tied); None: one rank, in this process. Tied, a pipeline's last
# stage keeps its own copy of the embedding whose optimizer state is stored under the whole
# model's name: saved by a pipeline, loaded into one, and the other way round. Split experts
# are saved whole under one name each (DTensors split by expert), and context parallelism
# changes nothing a checkpoint holds: both load into layouts without them, and back. An MoE's
# weights are whole DTensors under tp (replicated) as under ep (split): saved by one, loaded by
# pipeline stages with context parallelism.
Layout = dict[str, Any] | None
PAIRS: dict[str, tuple[Layout, Layout, str]] = {
    "fsdp-to-tp": ({"dp_shard": 4}, {"tp": 2, "dp_shard": 2}, "tied"),
    "tp-pp-to-fsdp": ({"tp": 2, "pp": 2}, {"dp_shard": 4}, "untied"),
    "pp-to-one-rank": ({"pp": 2, "dp_shard": 2}, None, "tied"),
    "interleaved-to-1f1b": (
        {"pp": 2, "pp_schedule": "interleaved_1f1b"},
        {"pp": 2, "pp_schedule": "1f1b"},
        "tied",
    ),
    "one-rank-to-tp-pp": (None, {"tp": 2, "pp": 2}, "tied"),
    "cp2-to-one-rank": ({"cp": 2, "dp_shard": 2}, None, "tied"),
    "one-rank-to-cp2": (None, {"cp": 2, "tp": 2}, "untied"),
    "ep2-to-one-rank": ({"ep": 2}, None, "moe"),
    "one-rank-to-ep2": (None, {"ep": 2, "dp_shard": 2, "dp_replicate": 2}, "moe"),
    "ep4-to-ep2": ({"ep": 4}, {"ep": 2}, "moe"),
    "ep2-tp2-to-pp2-cp2": ({"ep": 2, "tp": 2}, {"pp": 2, "cp": 2}, "moe"),
    "cp2-pp2-to-tp2": ({"cp": 2, "pp": 2}, {"tp": 2, "dp_shard": 2}, "tied"),
}
MOE = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16, bias_update_rate=0.01)
# pp=2 on 4 ranks: the mesh is pp x dp_shard, pp outermost (goodput.train.parallel.mesh), so ranks 2
# and 3 hold the last stage and nothing else.
LAST_STAGE_RANKS = (2, 3)


def layout_config(
    base: RunConfig, run_dir: Path, steps: int, variant: str, parallel: Layout
) -> RunConfig:
    """The tiny run with a model that tp=2 splits (vocab 64) and pp=2 x 2 stages cut (4
    layers); a flat LR after warmup, so a run's length changes no step's LR and the short run
    trains exactly as the straight run's first steps."""
    model = replace(
        base.model,
        vocab_size=64,
        num_layers=4,
        tie_embeddings=variant != "untied",
        moe=MOE if variant == "moe" else None,
    )
    return replace(
        base,
        model=model,
        parallel=replace(base.parallel, **(parallel or {})),
        train=replace(base.train, steps=steps, run_dir=str(run_dir), tensorboard=False),
        schedule=replace(base.schedule, kind="wsd", decay_fraction=0.0),
        checkpoint=replace(base.checkpoint, interval_steps=SAVED_AT, async_save=False),
    )


@dataclass(frozen=True)
class Outcome:
    """What one ``train()`` left: its losses, rank 0's output, and its checkpoints right after
    (a later run in the same directory changes them)."""

    losses: list[float]
    out: str
    checkpoints: list[tuple[int, bool]]
    latest: str | None


def train_in_turn(rank, world_size, runs):
    """Each ``(cfg, fault plan or None)`` of ``runs`` in turn, in this one process group."""
    torch.set_num_threads(1)  # 4 ranks share the test machine's cores
    outcomes = []
    for cfg, faults in runs:
        if faults:
            os.environ["GOODPUT_FAULTS"] = faults
        try:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                losses = train(cfg)
        finally:
            os.environ.pop("GOODPUT_FAULTS", None)
        outcomes.append(outcome(cfg, losses, out.getvalue()))
    return outcomes if rank == 0 else None


def train_here(cfg: RunConfig) -> Outcome:
    """``cfg`` on one rank, in this process."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        losses = train(cfg)
    return outcome(cfg, losses, out.getvalue())


def outcome(cfg: RunConfig, losses: list[float], out: str) -> Outcome:
    root = checkpoints_dir(cfg.train.run_dir)
    latest = root / LATEST
    return Outcome(
        losses,
        out,
        [(c.step, c.complete) for c in list_checkpoints(root)],
        latest.read_text().strip() if latest.is_file() else None,
    )


def recorded_losses(run_dir: str) -> dict[int, float]:
    lines = (Path(run_dir) / METRICS).read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def base(run_dirs) -> RunConfig:
    return tiny_run_config(run_dirs)


VARIANTS = ("tied", "untied", "moe")


@pytest.fixture(scope="module")
def references(base, run_dirs) -> dict[str, Path]:
    """Run directories of straight 6-step runs on one rank, by model variant: the losses every
    layout is held to, and (untied) the one-rank checkpoint of step 3."""
    directories = {}
    for variant in VARIANTS:
        directories[variant] = run_dirs / f"straight-{variant}"
        train(layout_config(base, directories[variant], STEPS, variant, None))
    return directories


@pytest.fixture(scope="module")
def layout_runs(base, run_dirs) -> dict[str, Outcome]:
    """Every run of a pair, by name: the short run saved at step 3 in the save layout and its
    resume at 6 steps in the load layout, in the same run directory; and a pp run whose save of
    step 2 fails on the last stage's ranks, and its rerun. The one-rank saves run here first,
    the 4-rank runs in one group, the one-rank resumes here last."""
    here_first: dict[str, RunConfig] = {}
    group: dict[str, tuple[RunConfig, str | None]] = {}
    here_last: dict[str, RunConfig] = {}
    for name, (save_layout, load_layout, variant) in PAIRS.items():
        saved = layout_config(base, run_dirs / name, SAVED_AT, variant, save_layout)
        resumed = layout_config(base, run_dirs / name, STEPS, variant, load_layout)
        if save_layout is None:
            here_first[f"{name}/saved"] = saved
        else:
            group[f"{name}/saved"] = (saved, None)
        if load_layout is None:
            here_last[f"{name}/resumed"] = resumed
        else:
            group[f"{name}/resumed"] = (resumed, None)
    failing = layout_config(base, run_dirs / "failing-save", 2, "tied", {"pp": 2})
    failing = replace(failing, checkpoint=replace(failing.checkpoint, interval_steps=1))
    plan = run_dirs / "faults.json"
    faults = [
        {"id": rank, "kind": "save-fail", "step": 2, "rank": rank} for rank in LAST_STAGE_RANKS
    ]
    plan.write_text(json.dumps({"fired_dir": str(run_dirs / "fired"), "faults": faults}))
    group["failing-save"] = (failing, str(plan))
    group["failing-save/rerun"] = (failing, str(plan))  # fired once: this one's saves succeed
    outcomes = {name: train_here(cfg) for name, cfg in here_first.items()}
    in_group = run_distributed(train_in_turn, 4, list(group.values()), timeout_s=600)[0]
    outcomes.update(zip(group, in_group, strict=True))
    outcomes.update({name: train_here(cfg) for name, cfg in here_last.items()})
    return outcomes


@pytest.mark.parametrize("name", PAIRS)
def test_a_checkpoint_resumes_in_another_layout_as_a_straight_run_goes_on(
    name, run_dirs, references, layout_runs
):
    variant = PAIRS[name][2]
    run_dir = run_dirs / name
    saved, resumed = layout_runs[f"{name}/saved"], layout_runs[f"{name}/resumed"]
    assert saved.checkpoints == [(SAVED_AT, True)]
    assert f"resume: from {step_dir(checkpoints_dir(run_dir), SAVED_AT)} (step 3)" in resumed.out
    assert len(resumed.losses) == STEPS - SAVED_AT
    straight, recorded = recorded_losses(references[variant]), recorded_losses(run_dir)
    assert list(recorded) == list(straight) == list(range(1, STEPS + 1))
    assert [recorded[step] for step in range(1, SAVED_AT + 1)] == saved.losses
    assert [recorded[step] for step in range(SAVED_AT + 1, STEPS + 1)] == resumed.losses
    differences = [abs(recorded[step] - straight[step]) for step in straight]
    assert max(differences) < LOSS_TOLERANCE, differences
    assert recorded[STEPS] < recorded[SAVED_AT] - 0.1  # trained on: no run stuck at step 3


def test_a_save_failing_on_the_last_stage_only_is_not_complete(run_dirs, layout_runs):
    failed, rerun = layout_runs["failing-save"], layout_runs["failing-save/rerun"]
    root = checkpoints_dir(run_dirs / "failing-save")
    ranks = ", ".join(map(str, LAST_STAGE_RANKS))
    report = f"checkpoint: saving {step_dir(root, 2)} FAILED on rank(s) {ranks}: disk full"
    assert report in failed.out
    for rank in LAST_STAGE_RANKS:
        assert json.loads((run_dirs / "fired" / f"{rank}.json").read_text())["step"] == 2
    # Ranks 0 and 1 wrote theirs, yet the vote over every rank refused the marker: the failed
    # checkpoint is gone, latest stays, and a rerun falls back to step 1.
    assert failed.checkpoints == [(1, True)]
    assert failed.latest == step_dir(root, 1).name
    assert f"resume: from {step_dir(root, 1)} (step 1)" in rerun.out
    assert rerun.losses == failed.losses[1:]  # the same layout: bit for bit
    assert rerun.checkpoints == [(1, True), (2, True)]


def test_the_hf_export_of_a_tp_pp_checkpoint_equals_one_rank_s(
    run_dirs, references, layout_runs, tmp_path
):
    assert PAIRS["tp-pp-to-fsdp"][2] == "untied"  # the exported lm_head is the last stage's
    saved = {
        "tp-pp": step_dir(checkpoints_dir(run_dirs / "tp-pp-to-fsdp"), SAVED_AT),
        "one-rank": step_dir(checkpoints_dir(references["untied"]), SAVED_AT),
    }
    assert len(list(saved["tp-pp"].glob("*.distcp"))) == 4  # a shard from every rank
    exported = {}
    for name, directory in saved.items():
        assert main(["ckpt", "export-hf", str(directory), str(tmp_path / name)]) == 0
        exported[name] = load_file(tmp_path / name / "model.safetensors")
    tp_pp, one_rank = exported["tp-pp"], exported["one-rank"]
    assert tp_pp.keys() == one_rank.keys() and "lm_head.weight" in one_rank
    differences = {name: (tp_pp[name] - one_rank[name]).abs().max().item() for name in one_rank}
    assert max(differences.values()) < WEIGHT_TOLERANCE, differences
