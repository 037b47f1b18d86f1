"""A run of three data-mix stages through the real loop (stages start after steps 4 and 8):
resumed from a checkpoint before, at and after each boundary it trains on the very samples of
the straight run (its losses bit for bit), and on one rank after two; every metrics line says
its stage and the run's tokens so far; run.json records each stage's mixture within the
blend's bound; a stage appended on resume is accepted, a started stage changed is refused
naming it; and the wsd decay starts with the stage it names."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from goodput import rundir
from goodput.errors import GoodputError
from goodput.runfiles import read_stage_mixtures, read_steps
from goodput.testing.dist import run_distributed
from goodput.testing.stages import staged_run_config
from goodput.train.config.run import RunConfig, StageConfig
from goodput.train.config.schedule import ScheduleConfig
from goodput.train.loop import train

pytestmark = pytest.mark.timeout(300)

STARTS = (0, 4, 8)  # stage k's samples are those of steps STARTS[k] + 1 on
SAVED = (3, 4, 5, 7, 8, 9)  # a step before, at and after each boundary


def saving_every_step(cfg: RunConfig, run_dir: Path, resume: str = "auto") -> RunConfig:
    checkpoint = replace(cfg.checkpoint, interval_steps=1, keep_last=12, resume=resume)
    return replace(cfg, train=replace(cfg.train, run_dir=str(run_dir)), checkpoint=checkpoint)


def checkpoint_of(cfg: RunConfig, step: int) -> str:
    return str(rundir.step_dir(rundir.checkpoints_dir(Path(cfg.train.run_dir)), step))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[RunConfig, list[float]]:
    """The staged run, straight through, saving at every step."""
    folder = tmp_path_factory.mktemp("stages")
    cfg = saving_every_step(staged_run_config(folder, STARTS), folder / "straight")
    return cfg, train(cfg)


def test_every_metrics_line_says_its_stage_and_the_tokens_so_far(straight):
    cfg, _ = straight
    lines = list(read_steps(Path(cfg.train.run_dir) / rundir.METRICS, require=("stage", "tokens")))
    assert [line.raw["stage"] for line in lines] == [0] * 4 + [1] * 4 + [2] * 4
    assert [line.raw["tokens"] for line in lines] == [
        step * cfg.train.tokens_per_step for step in range(1, 13)
    ]


def test_run_json_records_each_stage_within_the_mixture_bound(straight):
    cfg, _ = straight
    record = json.loads((Path(cfg.train.run_dir) / rundir.RUN_RECORD).read_text())
    stages = read_stage_mixtures(record, "run.json")
    assert [stage.start_step for stage in stages] == list(STARTS)
    assert [stage.file_list for stage in stages] == list(cfg.data.file_lists())
    global_batch = cfg.train.tokens_per_step // cfg.train.seq_len
    ends = [*STARTS[1:], cfg.train.steps]
    for stage, end in zip(stages, ends, strict=True):
        span = (end - stage.start_step) * global_batch
        for share in stage.corpora:  # within one sample of the target over the whole stage
            assert abs(share.achieved - share.target) * span <= 1 + 1e-9, share
        assert sum(share.achieved for share in stage.corpora) == pytest.approx(1.0)


@pytest.mark.parametrize("saved_at", SAVED)
def test_a_resume_near_a_boundary_trains_on_the_straight_runs_samples(straight, tmp_path, saved_at):
    cfg, losses = straight
    resumed = saving_every_step(cfg, tmp_path / "resumed", resume=checkpoint_of(cfg, saved_at))
    assert train(resumed) == losses[saved_at:]  # exactly, step for step
    lines = list(read_steps(tmp_path / "resumed" / rundir.METRICS))
    assert lines[0].step == saved_at + 1
    assert lines[0].raw["tokens"] == (saved_at + 1) * cfg.train.tokens_per_step


def train_on_rank(rank: int, world_size: int, cfg: RunConfig) -> list[float]:
    return train(cfg)


def test_a_resume_on_one_rank_after_two_continues_across_the_boundary(straight, tmp_path):
    cfg, losses = straight
    two = saving_every_step(cfg, tmp_path / "two")
    two_losses = run_distributed(train_on_rank, 2, two, timeout_s=240)[0]
    # Two ranks sum the same samples in another order: a few ulps apart, not a sample apart.
    assert two_losses == pytest.approx(losses, rel=1e-5)
    one = saving_every_step(cfg, tmp_path / "one", resume=checkpoint_of(two, 4))
    assert train(one) == pytest.approx(two_losses[4:], rel=1e-5)
    lines = list(read_steps(tmp_path / "one" / rundir.METRICS))
    assert [(line.raw["stage"], line.raw["tokens"]) for line in lines[:2]] == [
        (1, 5 * cfg.train.tokens_per_step),
        (1, 6 * cfg.train.tokens_per_step),
    ]


def two_stages(cfg: RunConfig) -> RunConfig:
    assert cfg.data.stages is not None
    return replace(cfg, data=replace(cfg.data, stages=cfg.data.stages[:2]))


def test_a_stage_appended_on_resume_is_accepted(straight, tmp_path):
    # A flat LR after warmup: a 6-step run's steps are those of the 12-step run.
    flat = ScheduleConfig(kind="wsd", lr=1e-2, warmup_steps=2, decay_fraction=0.0)
    cfg = replace(straight[0], schedule=flat)
    losses = train(saving_every_step(cfg, tmp_path / "three"))
    first = saving_every_step(two_stages(cfg), tmp_path / "run")
    train(replace(first, train=replace(first.train, steps=6)))
    appended = saving_every_step(cfg, tmp_path / "run", resume=checkpoint_of(first, 6))
    again = train(appended)  # the third stage starts after step 8: not yet read
    assert again == losses[6:]  # the samples of the run that had its three stages from the start
    lines = list(read_steps(tmp_path / "run" / rundir.METRICS))
    assert [line.raw["stage"] for line in lines] == [0] * 4 + [1] * 4 + [2] * 4


def test_a_started_stage_changed_on_resume_is_refused_naming_it(straight, tmp_path):
    cfg, _ = straight
    assert cfg.data.stages is not None
    first, second, third = cfg.data.stages
    changed = StageConfig(file_list=third.file_list, start_step=second.start_step)
    other = replace(cfg, data=replace(cfg.data, stages=(first, changed, third)))
    resumed = saving_every_step(other, tmp_path / "changed", resume=checkpoint_of(cfg, 5))
    with pytest.raises(GoodputError, match=r"stage 1 \(file list .*stage2.txt\) started"):
        train(resumed)


def test_the_wsd_decay_starts_with_the_last_stage(straight, tmp_path):
    cfg, _ = straight
    schedule = ScheduleConfig(kind="wsd", lr=1e-2, warmup_steps=2, decay_start="stage:2")
    decayed = replace(saving_every_step(cfg, tmp_path / "wsd"), schedule=schedule)
    train(decayed)
    lrs = [line.raw["lr"] for line in read_steps(tmp_path / "wsd" / rundir.METRICS)]
    assert lrs[2:9] == [1e-2] * 7  # flat through step 9, the last stage's first
    assert all(later < earlier for earlier, later in zip(lrs[8:], lrs[9:], strict=False))


def test_a_decay_start_naming_no_stage_is_refused(straight):
    cfg, _ = straight
    schedule = ScheduleConfig(kind="wsd", decay_start="stage:3")
    with pytest.raises(GoodputError, match="names a stage the run does not have"):
        replace(cfg, schedule=schedule)
