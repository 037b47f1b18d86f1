"""Every ``goodput`` command line of the README and docs/ that names a shipped recipe
(``configs/*.toml`` but the CPU demo) runs as written, up to where real hardware is needed.

- ``goodput plan ...`` and ``goodput model ...`` run as written (the planner's ``--verify`` too:
  the whole machine under a fake process group, one rank materialised on this CPU; the 80B's
  takes about 20 s, most of this file's time, and docs/ shows no other).
- ``goodput launch ... -- goodput train RECIPE ...`` runs with ``--dry-run``, inside a stand-in
  allocation of the line's ``--nhosts`` hosts (PBS for the profiles of PBS machines, else
  Slurm), and the train command it launches is loaded as ``goodput train`` loads it and held to
  the trainer's start-up checks on the world the launch planned (``train.config.check_world``).
- ``goodput submit --submit ... -- goodput launch ...`` runs as written with a stand-in ``sbatch``
  or ``qsub`` (it loads and checks the train line's config itself), then its launch line as
  above, in an allocation of the job's ``--nhosts``.

docs/plan.md's examples are run by tests/unit/plan/test_command.py, which also compares their
output with the page's. Nothing here trains or builds a model but ``--verify``'s one rank.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from goodput.cli import build_parser, main
from goodput.commands import after_dashes
from goodput.commands import launch as launch_command
from goodput.config import load_config
from goodput.launch.submit import CLIENTS
from goodput.testing.doc_commands import command_lines
from goodput.testing.jobs import JOB_PREFIXES, JOB_VARS, REPO, run_goodput
from goodput.train.config.run import RunConfig, check_world

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN_ELSEWHERE = {"plan.md"}  # tests/unit/plan/test_command.py
RECIPE = re.compile(r"\bconfigs/(?!tiny-cpu\.)[\w-]+\.toml\b")
PLANNED = re.compile(r"(\d+) host\(s\) x (\d+) = (\d+) rank\(s\)")
PBS_PROFILES = ("aurora", "polaris")  # the others (perlmutter, frontier, generic): Slurm
JOB_IDS = {"slurm": "4242", "pbs": "4242.pbs"}


def recipe_lines() -> list[tuple[str, str]]:
    return [
        (page.name, line)
        for page in PAGES
        if page.name not in RUN_ELSEWHERE
        for line in command_lines(page.read_text())
        if line.startswith("goodput ") and RECIPE.search(line)
    ]


def test_the_walkthrough_runs_a_recipe_of_each_kind():
    kinds = {shlex.split(line)[1] for page, line in recipe_lines() if page == "walkthrough.md"}
    assert {"plan", "launch", "submit"} <= kinds
    verified = [line for _, line in recipe_lines() if "--verify" in line]
    assert any("llama-80b" in line for line in verified)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("page", "line"), recipe_lines(), ids=lambda x: x[:60])
def test_a_documented_recipe_command_runs(page, line, tmp_path, monkeypatch, capsys):
    argv = shlex.split(line)
    if argv[1] in ("plan", "model"):
        result = run_goodput(*argv[1:], cwd=REPO, timeout=540)
        assert result.returncode == 0, f"{page}: {line}\n{result.stdout}\n{result.stderr}"
        assert "DISAGREE" not in result.stdout  # --verify: built and estimated state agree
    elif argv[1] == "launch":
        _dry_run_launch(argv, _option(argv, "--nhosts"), tmp_path, monkeypatch, capsys)
    elif argv[1] == "submit":
        _submit(argv, tmp_path, monkeypatch, capsys)
    else:
        pytest.fail(f"{page}: no runner for {line!r}: teach this test how to run it")


def _option(argv: list[str], name: str) -> int:
    """The value of ``name`` in a ``goodput launch`` argv (the part before its ``--``)."""
    own = argv[: argv.index("--")] if "--" in argv else argv
    return int(own[own.index(name) + 1])


def _scheduler(launch: list[str]) -> str:
    """The scheduler of the machine a ``goodput launch`` line's profile names."""
    own = launch[: launch.index("--")]
    profile = own[own.index("--profile") + 1] if "--profile" in own else "generic"
    return "pbs" if profile in PBS_PROFILES else "slurm"


def _outside_any_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(JOB_PREFIXES) or key in JOB_VARS:
            monkeypatch.delenv(key)


def _dry_run_launch(argv, nhosts, tmp_path, monkeypatch, capsys) -> None:
    """``argv`` (``goodput launch --nhosts N ... -- goodput train ...``) with ``--dry-run``, in a
    stand-in job of ``nhosts`` hosts; then its train command's config on the world it
    planned."""
    _outside_any_job(monkeypatch)
    hosts = [f"x{n:04d}" for n in range(nhosts)]
    if _scheduler(argv) == "pbs":
        nodefile = tmp_path / "nodefile"
        nodefile.write_text("".join(f"{host}\n" for host in hosts))
        monkeypatch.setenv("PBS_JOBID", "4242.pbs")
        monkeypatch.setenv("PBS_NODEFILE", str(nodefile))
    else:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        monkeypatch.setenv("SLURM_JOB_NODELIST", f"x[0000-{nhosts - 1:04d}]")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["launch", "--dry-run", *argv[2:]]) == 0
    out, err = capsys.readouterr()
    planned = PLANNED.search(err)
    assert planned and ("srun" in out or "mpiexec" in out), err
    assert int(planned[1]) == _option(argv, "--nhosts")  # of the job's hosts, the rest spares
    ranks_per_host, world = int(planned[2]), int(planned[3])
    args, unknown = launch_command.parse(argv[2:])
    command = after_dashes(args.cmd)
    assert not unknown and command[:2] == ["goodput", "train"], argv
    train = build_parser().parse_args(command[1:])
    cfg = load_config(RunConfig, REPO / train.config, train.overrides)
    check_world(cfg, world, ranks_per_host)


def _submit(argv, tmp_path, monkeypatch, capsys) -> None:
    """``argv`` (``goodput submit --submit ... -- goodput launch ...``) as written, with
    stand-in schedulers; then its launch line in a job of the chain's ``--nhosts``."""
    launch = argv[argv.index("--") + 1 :]
    scheduler = _scheduler(launch)
    own = argv[: argv.index("--")]
    if "--scheduler" in own:
        assert own[own.index("--scheduler") + 1] == scheduler, "not the profile's scheduler"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    client = bin_dir / CLIENTS[scheduler]  # alone on PATH, as on the cluster's login node
    client.write_text(f"#!/bin/sh\necho {JOB_IDS[scheduler]}\n")
    client.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    _outside_any_job(monkeypatch)
    shutil.copytree(REPO / "configs", tmp_path / "configs")  # submit loads the train line's
    monkeypatch.chdir(tmp_path)
    assert main(argv[1:]) == 0
    out = capsys.readouterr().out
    assert out.split()[0].startswith("4242"), out
    script = next(Path(tmp_path).glob("runs/*/chain.*"))
    assert shlex.join(launch) in script.read_text()
    _dry_run_launch(launch, _option(argv, "--nhosts"), tmp_path, monkeypatch, capsys)
