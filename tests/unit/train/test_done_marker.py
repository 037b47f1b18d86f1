"""RUN_DIR/done, the file a `goodput submit` job chain stops at: written once every step has run,
never by a run that stopped early."""

from pathlib import Path

import pytest

from goodput.rundir import DONE
from goodput.train import loop


def test_a_completed_run_writes_the_done_marker(run_config):
    run_dir = Path(run_config.train.run_dir)
    loop.train(run_config)
    assert (run_dir / DONE).read_text() == ""
    assert not list(run_dir.glob(".done.*"))  # written atomically: no temp file left


def test_a_run_that_fails_midway_writes_none(run_config, monkeypatch):
    real_step, calls = loop.train_step, []

    def step_that_fails_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", step_that_fails_third)
    with pytest.raises(RuntimeError, match="device lost"):
        loop.train(run_config)
    run_dir = Path(run_config.train.run_dir)
    assert (run_dir / "metrics.jsonl").exists() and not (run_dir / DONE).exists()
