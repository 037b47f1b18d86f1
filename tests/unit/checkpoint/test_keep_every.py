"""``[checkpoint] keep_every_steps``: milestones kept beyond ``keep_last`` — the rule, the key's
refusals, and a real run's pruning."""

import tomllib
from dataclasses import replace

import pytest

from goodput.checkpoint.config import CheckpointConfig
from goodput.checkpoint.load import find_checkpoint
from goodput.checkpoint.save import kept_steps
from goodput.config import from_table
from goodput.errors import GoodputError
from goodput.rundir import checkpoints_dir, list_checkpoints
from goodput.testing.doc_commands import FENCE
from goodput.testing.jobs import REPO
from goodput.train.loop import train


@pytest.mark.parametrize(
    ("keep_last", "every", "kept"),
    [
        (2, 0, {9, 10}),  # no milestones: keep_last alone
        (2, 4, {0, 4, 8, 9, 10}),
        (1, 5, {0, 5, 10}),  # the newest is a milestone too: counted once
        (3, 100, {0, 8, 9, 10}),  # step 0 (an imported model) is a multiple of any N
    ],
)
def test_the_newest_and_the_milestones_are_kept(keep_last, every, kept):
    cfg = CheckpointConfig(keep_last=keep_last, keep_every_steps=every)
    assert kept_steps(list(range(11)), cfg) == kept


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (-1, "'checkpoint.keep_every_steps' = -1 is not in [0,"),
        (2**40 + 1, "'checkpoint.keep_every_steps' = 1099511627777 is not in [0,"),
        (2.5, "'checkpoint.keep_every_steps' must be int"),
        (True, "'checkpoint.keep_every_steps' must be int, got True"),
        ("4", "'checkpoint.keep_every_steps' must be int"),
        (float("nan"), "'checkpoint.keep_every_steps' must be int"),
    ],
)
def test_a_bad_keep_every_steps_names_the_key(value, says):
    with pytest.raises(GoodputError, match="run.toml") as error:
        from_table(CheckpointConfig, {"keep_every_steps": value}, "run.toml", "checkpoint.")
    assert says in error.value.render() and error.value.code == 2


def test_a_run_keeps_its_milestones_and_prunes_the_rest(run_config, tmp_path):
    checkpoint = replace(
        run_config.checkpoint, interval_steps=1, keep_last=2, keep_every_steps=3, async_save=False
    )
    cfg = replace(
        run_config,
        train=replace(run_config.train, run_dir=str(tmp_path / "run")),
        checkpoint=checkpoint,
    )
    train(cfg)
    root = checkpoints_dir(tmp_path / "run")
    saved = list_checkpoints(root)
    assert [(c.step, c.complete) for c in saved] == [(3, True), (6, True), (7, True), (8, True)]
    assert find_checkpoint(root, "auto") == saved[-1].path  # the newest, not a milestone


def test_the_docs_example_keeps_what_the_docs_say():
    """docs/checkpoints.md's [checkpoint] table and its run at step 12,000."""
    (block,) = [
        body
        for language, body in FENCE.findall((REPO / "docs" / "checkpoints.md").read_text())
        if language == "toml" and "keep_every_steps" in body
    ]
    cfg = from_table(CheckpointConfig, tomllib.loads(block)["checkpoint"], "checkpoints.md")
    saved = list(range(cfg.interval_steps, 12_001, cfg.interval_steps))
    assert sorted(kept_steps(saved, cfg)) == [5_000, 10_000, 11_500, 12_000]
