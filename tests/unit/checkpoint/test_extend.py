"""Extending a run through the real loop: a rerun with more ``train.steps`` resumes its newest
checkpoint without ``--allow-data-change`` (its longer blend starts with the samples already
trained on) and continues exactly as a straight run would; a rerun that also changes the data is
still refused, naming the component."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from goodput.errors import GoodputError
from goodput.rundir import checkpoints_dir, step_dir
from goodput.testing.tiny import write_counting_corpus
from goodput.train.loop import train

BOTH_CORPORA = "0.6 counting counting\n0.4 other other\n"


@pytest.fixture
def two_corpora(run_config):
    """The tiny run over two corpora, LR flat after warmup: a run's length changes no step's
    LR, so an extended run and a straight one compare bit for bit."""
    file_list = Path(run_config.data.file_list)
    write_counting_corpus(file_list.parent / "other", num_docs=150)
    file_list.write_text(BOTH_CORPORA)
    flat = replace(run_config.schedule, kind="wsd", decay_fraction=0.0)
    checkpoint = replace(run_config.checkpoint, interval_steps=4)
    return replace(run_config, schedule=flat, checkpoint=checkpoint)


def run(cfg, output, steps, **data_changes):
    return train(
        replace(
            cfg,
            train=replace(cfg.train, steps=steps, run_dir=str(output)),
            data=replace(cfg.data, **data_changes),
        )
    )


def loader_state(output, step):
    state = json.loads((step_dir(checkpoints_dir(output), step) / "train_state.json").read_text())
    return state["loader"]


def test_a_longer_rerun_continues_as_a_straight_run_would(two_corpora, tmp_path, capsys):
    assert len(run(two_corpora, tmp_path / "run", steps=8)) == 8
    extended = run(two_corpora, tmp_path / "run", steps=16)  # auto: resumes step 8
    out = capsys.readouterr().out
    assert "resume: config differs from the checkpoint's: train.steps: 8 -> 16" in out
    straight = run(two_corpora, tmp_path / "straight", steps=16)
    assert extended == straight[8:]  # exactly, step for step
    first, last = loader_state(tmp_path / "run", 8), loader_state(tmp_path / "run", 16)
    assert first["fingerprint"] != last["fingerprint"]  # a longer blend...
    assert last == loader_state(tmp_path / "straight", 16)  # ...read as the straight run read it
    assert last["consumed_samples"] == 128


@pytest.mark.parametrize("component", ["seed", "weights"])
def test_a_longer_rerun_with_other_data_is_still_refused(two_corpora, tmp_path, component):
    run(two_corpora, tmp_path / "run", steps=8)
    reweighted = tmp_path / "data" / "reweighted.txt"
    reweighted.write_text(BOTH_CORPORA.replace("0.6", "0.7").replace("0.4", "0.3"))
    other_data = {"seed": 99} if component == "seed" else {"file_list": str(reweighted)}
    with pytest.raises(GoodputError, match=rf"\(num_samples, {component} changed\)"):
        run(two_corpora, tmp_path / "run", steps=16, **other_data)
