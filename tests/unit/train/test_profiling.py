"""``[profile]``: its limits and hostile values as one line each; the window a start can still
trace (a resume past it, a run that ends inside it); a real 2-rank run under ``goodput launch``
that writes one Chrome trace per rank with a ``ProfilerStep#N`` span per traced step, run as
docs/training.md shows it; and a run without ``[profile]`` that starts no profiler and writes
no profile folder."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.profiler

from goodput import rundir
from goodput.config import load_config, to_toml
from goodput.errors import ExitCode, GoodputError
from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import REPO, outside_any_job
from goodput.testing.tiny import write_counting_corpus
from goodput.train import loop
from goodput.train.config.profile import ProfilerConfig
from goodput.train.config.run import RunConfig
from goodput.train.profiling import build_profiler

TINY = REPO / "configs" / "tiny-cpu.toml"
SECTION = re.compile(r"^## Why is it slow: the profiler\n(.*?)(?=^## |\Z)", re.S | re.M)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("profile.steps=[3,2]", "[profile]: steps [3, 2] end before they start; write the first"),
        ("profile.steps=[1,101]", "steps [1, 101] are 101 steps; at most 100 are traced"),
        ("profile.steps=[0,3]", "'profile.steps[0]' = 0 is not in [1, 2**53]"),
        ("profile.steps=[1,9007199254740993]", "'profile.steps[1]' = 9007199254740993 is not in"),
        ("profile.steps=[-5,3]", "'profile.steps[0]' = -5 is not in [1, 2**53]"),
        ("profile.steps=[2]", "'profile.steps' must be a list of 2, got [2]"),
        ("profile.steps=[2,3,4]", "'profile.steps' must be a list of 2"),
        ("profile.steps=2", "'profile.steps' must be a list, got 2"),
        ("profile.steps=[2.5,3]", "'profile.steps[0]' must be int, got 2.5"),
        ("profile.steps=[true,3]", "'profile.steps[0]' must be int, got True"),
        ("profile.steps=['2','3']", "'profile.steps[0]' must be int, got '2'"),
        ("profile.memory_snapshot_on_oom=1", "'profile.memory_snapshot_on_oom' must be true or"),
        ("profile.every=5", "unknown key 'profile.every'; valid keys in [profile]:"),
    ],
)
def test_a_bad_profile_table_is_one_usage_line(override, message):
    with pytest.raises(GoodputError) as error:
        load_config(RunConfig, TINY, [override])
    line = error.value.render()
    assert error.value.code == ExitCode.USAGE and "\n" not in line
    assert message in line


def test_the_widest_window_the_default_and_the_resolved_config(tmp_path):
    cfg = load_config(RunConfig, TINY, ["profile.steps=[5,104]"])
    assert cfg.profile.steps == (5, 104)
    assert load_config(RunConfig, TINY).profile == ProfilerConfig()
    resolved = tmp_path / "config.toml"  # what the run directory keeps, read back the same
    resolved.write_text(to_toml(cfg))
    assert "[profile]\nsteps = [5, 104]\n" in resolved.read_text()
    assert load_config(RunConfig, resolved) == cfg


@pytest.mark.parametrize(
    ("first_step", "last_step", "window", "said"),
    [
        (1, 10, (5, 7), None),
        (6, 10, (6, 7), "profile: steps [5, 7]: this start resumes at step 6; tracing steps 6-7"),
        (8, 10, None, "profile: steps [5, 7]: this start resumes at step 8; nothing is recorded"),
        (1, 6, (5, 6), "profile: steps [5, 7]: the run ends at step 6; tracing steps 5-6"),
        (1, 4, None, "profile: steps [5, 7]: the run ends at step 4; nothing is recorded"),
    ],
)
def test_a_start_traces_what_is_left_of_the_window_and_says_what_is_not(
    tmp_path, capsys, first_step, last_step, window, said
):
    config = ProfilerConfig(steps=(5, 7))
    for rank in (1, 0):  # rank 0 alone says it
        profiler = build_profiler(
            config, tmp_path, rank=rank, first_step=first_step, last_step=last_step
        )
        assert (profiler and profiler.window) == window
    assert capsys.readouterr().out == (f"{said}\n" if said else "")


def test_off_and_memory_snapshot_without_a_gpu_build_nothing(tmp_path, capsys):
    assert build_profiler(ProfilerConfig(), tmp_path, rank=0, first_step=1, last_step=9) is None
    assert capsys.readouterr().out == ""
    if torch.cuda.is_available():
        pytest.skip("the CPU path: with a GPU the snapshot is kept")
    snapshot = ProfilerConfig(memory_snapshot_on_oom=True)
    assert build_profiler(snapshot, tmp_path, rank=0, first_step=1, last_step=9) is None
    assert capsys.readouterr().out == (
        "profile: memory_snapshot_on_oom needs a CUDA device; nothing is recorded\n"
    )


def test_a_run_stopped_inside_the_window_writes_the_steps_it_began(tmp_path):
    profiler = build_profiler(
        ProfilerConfig(steps=(2, 5)), tmp_path, rank=3, first_step=1, last_step=9
    )
    assert profiler is not None
    for step in (1, 2, 3):
        profiler.before_step(step)
        torch.ones(8).sum()
        profiler.after_step(step)
    profiler.before_step(4)  # the run stops inside step 4
    profiler.close()
    trace = rundir.profile_trace(tmp_path, 3, 2, 4)
    assert step_spans(trace) == {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}
    assert sorted(p.name for p in (tmp_path / rundir.PROFILE).iterdir()) == [
        "rank-00003.steps-2-4.pt.trace.json"  # nothing else: no temp file left
    ]


@pytest.mark.timeout(120)
def test_the_documented_command_traces_each_rank(tmp_path):
    """docs/training.md's example as written, in a folder holding the shipped configs, with a
    counting corpus where tiny-cpu.toml reads the demo's data (the demo's own takes ~20 s to
    build, and the profiler does not care what it trains on)."""
    (section,) = SECTION.findall((REPO / "docs" / "training.md").read_text())
    (line,) = command_lines(section, ("sh",))
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    (tmp_path / "demo").mkdir()
    write_counting_corpus(tmp_path / "demo" / "counting")
    (tmp_path / "demo" / "file_list.txt").write_text("1.0 counting counting\n")
    env = outside_any_job(PATH=f"{Path(sys.executable).parent}:{outside_any_job()['PATH']}")
    result = subprocess.run(
        ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "demo" / "run"
    traces = sorted((run_dir / rundir.PROFILE).iterdir())
    assert [p.name for p in traces] == [
        "rank-00000.steps-2-3.pt.trace.json",
        "rank-00001.steps-2-3.pt.trace.json",
    ]
    for trace in traces:
        assert step_spans(trace) == {"ProfilerStep#2", "ProfilerStep#3"}
    assert "profile: steps 2-3 traced: demo/run/profile/rank-00000.steps-2-3.pt" in result.stdout


def test_a_run_without_profile_starts_no_profiler(run_config, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a run without [profile] built a profiler")

    # Not record_function: torch's optimizers open one every step, profiler or not.
    monkeypatch.setattr(torch.profiler.profile, "__init__", refuse)
    loop.train(run_config)
    run_dir = Path(run_config.train.run_dir)
    assert (run_dir / rundir.METRICS).is_file() and not (run_dir / rundir.PROFILE).exists()


def step_spans(trace: Path) -> set[str]:
    """The ``ProfilerStep#N`` spans of a Chrome trace, which must parse as JSON."""
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
