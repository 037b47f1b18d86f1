"""``goodput submit``: the batch scripts it writes, the options it refuses, and real job chains.

Slurm chains run for real on this machine's single-node Slurm (CI starts it with
``.ci/start-slurm``; elsewhere those tests skip, as in test_slurm.py). PBS cannot: there is no PBS
server to run on one machine, so the PBS script is run by bash as a faked PBS job (``PBS_JOBID``
and ``PBS_NODEFILE`` set) with small stand-in ``qsub``/``qdel`` scripts first on PATH that record
their argv — a mock only because a PBS server cannot exist here. The ``goodput launch`` inside that
job is real, under MPICH's Hydra mpiexec, and so is the command it runs.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from goodput import cli
from goodput.launch.history import read_attempts
from goodput.testing.jobs import outside_any_job

BIN = Path(sys.executable).parent  # this venv's bin: the jobs' `goodput` is found here
# A chain's `goodput train CONFIG` line is loaded when submitted: the tests' run.toml is the demo's.
CONFIGS = Path(__file__).parents[3] / "configs"
CHAIN_TIMEOUT_S = 90
HOSTILE = ["$(touch PWNED)", ";", "a'b\"c", "`touch PWNED`", "$HOME", "x && touch PWNED"]

# The command a chain runs: it appends ["run", *EXTRA] to LOG (the file the stand-ins write to as
# well, so the log shows the order of events), prints step=N on its N-th run unless STEP is 0 (a
# run that gains a step, as goodput launch counts them) and writes DONE on the DONE_AT-th run
# (0: never).
RUN = """\
import json, sys
log, done, done_at, code, step, *extra = sys.argv[1:]
with open(log, "a") as f:
    f.write(json.dumps(["run", *extra]) + "\\n")
with open(log) as f:
    runs = sum(json.loads(line)[0] == "run" for line in f)
if int(step):
    print(f"step={runs}", flush=True)
if runs == int(done_at):
    open(done, "w").close()
sys.exit(int(code))
"""

# Records its name, argv, the chain position and the previous jobs it passes on; qsub prints a
# job id as the real one does: 42.pbs for the first it queues, then 43.pbs, ...
STAND_IN = f"""\
#!{sys.executable}
import json, os, sys
name = os.path.basename(sys.argv[0])
chain = [os.environ.get("GOODPUT_CHAIN_JOB"), os.environ.get("GOODPUT_CHAIN_PREVIOUS")]
with open(os.environ["SCHEDULER_LOG"], "a") as f:
    f.write(json.dumps([name, *sys.argv[1:], *chain]) + "\\n")
with open(os.environ["SCHEDULER_LOG"]) as f:
    queued = sum(json.loads(line)[0] == "qsub" for line in f)
if name == "qsub":
    print(f"{{41 + queued}}.pbs")
"""


def _run_line(
    log: Path, run_dir: Path, done_at: int, code: int = 0, extra=(), *, step=True, launch_dir=True
) -> list[str]:
    """The launch line: goodput launch running RUN, logging its attempts in RUN_DIR/launch
    (``launch_dir``), else in goodput launch's default, ./launch-JOBID."""
    command = [sys.executable, "-c", RUN, str(log), str(run_dir / "done"), str(done_at), str(code)]
    options = ["--run-dir", str(run_dir / "launch")] if launch_dir else []
    return ["goodput", "launch", *options, "--", *command, str(int(step)), *extra]


def _submit_args(run_dir: Path, *options: str, nhosts="2", time="01:00:00") -> list[str]:
    return ["submit", "--run-dir", str(run_dir), "--nhosts", nhosts, "--time", time, *options]


def _write(monkeypatch, tmp_path, capsys, options, launch_line) -> str:
    """Run `goodput submit` in-process from tmp_path; return the script's text."""
    monkeypatch.chdir(tmp_path)
    assert cli.main([*_submit_args(tmp_path / "run", *options), "--", *launch_line]) == 0
    return Path(capsys.readouterr().out.strip()).read_text()


def _launch_argv(script: str) -> list[str]:
    """The launch line as bash will split it: everything between "status=0" and "|| status"."""
    return shlex.split(script.split("status=0\n", 1)[1].split(" || status=$?\n", 1)[0])


def _child_env(**extra: str) -> dict[str, str]:
    """This environment outside any job, with this venv's `goodput` on PATH."""
    path = os.pathsep.join([str(BIN), os.environ["PATH"]])
    return outside_any_job(**{"PATH": path, **extra})


@pytest.fixture
def stand_ins(tmp_path):
    """A bin folder with recording qsub/qdel stand-ins, and the log they write."""
    bin_dir = tmp_path / "stand-ins"
    bin_dir.mkdir()
    for name in ("qsub", "qdel"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    return bin_dir, tmp_path / "events.jsonl"


def _events(log: Path) -> list[list]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# --- the scripts -------------------------------------------------------------------------------


def test_slurm_script_headers_and_chain_steps(monkeypatch, tmp_path, capsys):
    shutil.copy(CONFIGS / "tiny-cpu.toml", tmp_path / "run.toml")
    line = ["goodput", "launch", "--timeout", "1800", "--", "goodput", "train", "run.toml"]
    options = ["--scheduler", "slurm", "--account", "m4321", "--partition", "regular"]
    script = _write(monkeypatch, tmp_path, capsys, [*options, "--max-jobs", "4"], line)
    run_dir = tmp_path / "run"
    assert script.splitlines()[:8] == [
        "#!/bin/bash",
        "#SBATCH --job-name=run",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",  # the generic profile's one rank a host
        "#SBATCH --time=01:00:00",
        f"#SBATCH --output={run_dir}/%x-%j.out",
        "#SBATCH --account=m4321",
        "#SBATCH --partition=regular",
    ]
    assert "set -euo pipefail\n" in script and f"cd {tmp_path}\n" in script
    assert f"done_marker={run_dir}/done\n" in script and "max_jobs=4\n" in script
    assert (
        'GOODPUT_CHAIN_PREVIOUS=$recent sbatch --dependency=afterany:"$this_job" --parsable '
        '--export=ALL,GOODPUT_CHAIN_JOB "$script"' in script
    )
    assert 'scancel "$next"' in script and "exec " not in script
    # The successor is queued before the launch runs, and the launch is waited for.
    assert script.index("sbatch --dep") < script.index("goodput launch") < script.index("scancel")
    assert _launch_argv(script) == line
    subprocess.run(["bash", "-n", run_dir / "chain.sbatch"], check=True)


def test_old_nodes_spelling_writes_the_same_script_with_one_warning(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    shutil.copy(CONFIGS / "tiny-cpu.toml", tmp_path / "run.toml")
    line = ["--", "goodput", "launch", "--", "goodput", "train", "run.toml"]
    new = [*_submit_args(tmp_path / "new", "--scheduler", "slurm", "--job-name", "r"), *line]
    assert cli.main(new) == 0
    out, err = capsys.readouterr()
    assert err == ""
    expected = Path(out.strip()).read_text().replace(str(tmp_path / "new"), "RUN")
    old = [a if a != "--nhosts" else "--nodes" for a in new]
    old[old.index("--run-dir") + 1] = str(tmp_path / "old")
    assert cli.main(old) == 0
    out, err = capsys.readouterr()
    assert err == "goodput: warning: --nodes is deprecated; use --nhosts\n"
    assert Path(out.strip()).read_text().replace(str(tmp_path / "old"), "RUN") == expected


def test_pbs_script_headers_for_aurora(monkeypatch, tmp_path, capsys):
    options = ["--scheduler", "pbs", "--account", "AuroraGPT", "--queue", "prod"]
    options += ["--filesystems", "home:flare", "--job-name", "llama-20b"]
    line = ["goodput", "launch", "--profile", "aurora", "--", "true"]
    script = _write(monkeypatch, tmp_path, capsys, options, line)
    assert script.splitlines()[:11] == [
        "#!/bin/bash",
        "#PBS -N llama-20b",
        "#PBS -l select=2:mpiprocs=12",  # the profile's 12 ranks a node, on whole nodes
        "#PBS -l place=scatter:excl",
        "#PBS -l walltime=01:00:00",
        "#PBS -l filesystems=home:flare",
        "#PBS -A AuroraGPT",
        "#PBS -q prod",
        "#PBS -j oe",
        "#PBS -V",
        "# Written by `goodput submit`: one job of a chain that reruns the launch line below "
        "until the",
    ]
    assert 'qsub -W depend=afterany:"$this_job" -v GOODPUT_CHAIN_JOB "$script"' in script
    assert "this_job=${PBS_JOBID:?" in script
    assert 'qdel "$next"' in script and "max_jobs=10\n" in script
    subprocess.run(["bash", "-n", tmp_path / "run" / "chain.pbs"], check=True)


# --- the allocation fits the launch line ----------------------------------------------------------


@pytest.mark.parametrize(
    ("scheduler", "nhosts", "launch", "profile_var", "expected"),
    [
        ("slurm", "2", [], None, ["--nodes=2", "--ntasks-per-node=1"]),
        ("slurm", "1", ["--nproc", "2"], None, ["--nodes=1", "--ntasks-per-node=2"]),
        ("slurm", "2", ["--nproc", "8"], None, ["--nodes=2", "--ntasks-per-node=4"]),
        ("slurm", "2", ["--nproc", "3"], None, ["--nodes=2", "--ntasks-per-node=2"]),
        # --nhosts 2 of 3: the third host is a spare, and may run ranks later.
        ("slurm", "3", ["--nhosts", "2", "--ppn", "3"], None, ["--nodes=3", "--ntasks-per-node=3"]),
        (
            "slurm",
            "3",
            ["--nhosts", "2", "--nproc", "7"],
            None,
            ["--nodes=3", "--ntasks-per-node=4"],
        ),
        (
            "slurm",
            "2",
            ["--profile", "perlmutter"],
            None,
            ["--nodes=2", "--ntasks-per-node=4", "--exclusive"],
        ),
        (
            "slurm",
            "2",
            ["--profile", "frontier", "--ppn", "2"],
            None,
            ["--nodes=2", "--ntasks-per-node=2", "--exclusive"],
        ),
        # The profile of $GOODPUT_PROFILE, as goodput launch will pick it inside the job.
        ("slurm", "1", [], "frontier", ["--nodes=1", "--ntasks-per-node=8", "--exclusive"]),
        ("pbs", "2", ["--ppn", "4"], None, ["select=2:ncpus=4:mpiprocs=4", "place=scatter"]),
        (
            "pbs",
            "4",
            ["--nhosts", "3", "--nproc", "6"],
            None,
            ["select=4:ncpus=2:mpiprocs=2", "place=scatter"],
        ),
        ("pbs", "2", ["--profile", "polaris"], None, ["select=2:mpiprocs=4", "place=scatter:excl"]),
        ("pbs", "2", [], "aurora", ["select=2:mpiprocs=12", "place=scatter:excl"]),
    ],
)
def test_each_job_asks_for_the_ranks_per_host_its_launch_line_runs(
    monkeypatch, tmp_path, capsys, scheduler, nhosts, launch, profile_var, expected
):
    if profile_var:
        monkeypatch.setenv("GOODPUT_PROFILE", profile_var)
    else:
        monkeypatch.delenv("GOODPUT_PROFILE", raising=False)
    monkeypatch.chdir(tmp_path)
    argv = _submit_args(tmp_path / "run", "--scheduler", scheduler, nhosts=nhosts)
    assert cli.main([*argv, "--", "goodput", "launch", *launch, "--", "true"]) == 0
    script = Path(capsys.readouterr().out.strip()).read_text()
    if scheduler == "slurm":
        found = [line.removeprefix("#SBATCH ") for line in script.splitlines()]
        found = [line for line in found if line.startswith(("--nodes", "--ntasks", "--excl"))]
    else:
        found = [line.removeprefix("#PBS -l ") for line in script.splitlines()]
        found = [line for line in found if line.startswith(("select", "place"))]
    assert found == expected


@pytest.mark.parametrize(
    ("nhosts", "launch", "where", "said"),
    [
        ("2", ["--nhosts", "3"], "--nhosts", "3 hosts do not fit a job of --nhosts 2"),
        ("1", ["--nhosts", "100000"], "--nhosts", "100000 hosts do not fit a job of --nhosts 1"),
        ("2", ["--nproc", "5", "--ppn", "2"], "--nproc", "5 ranks do not fit 2 hosts x 2 per host"),
        ("2", ["--nproc", "1"], "--nproc", "1 ranks do not fit 2 hosts x 1 per host"),
        ("2", ["--nhosts", "2", "--ppn", "1", "--nproc", "3"], "--nproc", "do not fit"),
        ("1", ["--ppn", "1025"], "--ppn", "1025 ranks a host is more than 1024"),
        ("1", ["--nproc", "2049"], "--nproc", "2049 ranks a host is more than 1024"),
    ],
)
def test_a_launch_line_no_job_could_run_is_refused_at_submit_time(
    monkeypatch, tmp_path, capsys, nhosts, launch, where, said
):
    monkeypatch.chdir(tmp_path)
    argv = _submit_args(tmp_path / "run", "--scheduler", "slurm", nhosts=nhosts)
    assert cli.main([*argv, "--", "goodput", "launch", *launch, "--", "true"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"goodput: error: submit -- goodput launch {where}: "), line
    assert said in line and "; " in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_hostile_arguments_stay_single_arguments(monkeypatch, tmp_path, capsys, scheduler):
    line = [
        "goodput",
        "launch",
        "--",
        "python",
        "-c",
        "print(1)\nprint(2)",
        "$(rm -rf /)",
        *HOSTILE,
    ]
    script = _write(monkeypatch, tmp_path, capsys, ["--scheduler", scheduler], line)
    assert _launch_argv(script) == line
    assert "'$(rm -rf /)'" in script and "';'" in script
    subprocess.run(["bash", "-n", "-c", script], check=True)


def test_pbs_paths_are_quoted_wherever_they_appear(monkeypatch, tmp_path, capsys):
    # PBS puts no path in its headers, so any directory name is allowed; each one is quoted.
    workdir = tmp_path / "it's $(touch PWNED) here"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    run_dir = workdir / 'run "1"; `touch PWNED`'
    args = _submit_args(run_dir, "--scheduler", "pbs", "--job-name", "x")
    assert cli.main([*args, "--", "goodput", "launch", "--", "true"]) == 0
    script = Path(capsys.readouterr().out.strip()).read_text()
    variables = dict(
        shlex.split(line)[0].split("=", 1)
        for line in script.splitlines()
        if line.startswith(("script=", "done_marker="))
    )
    assert variables == {"script": str(run_dir / "chain.pbs"), "done_marker": str(run_dir / "done")}
    assert shlex.split(script.split("\ncd ", 1)[1].split("\n", 1)[0]) == [str(workdir)]


# --- refused options ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "where"),
    [
        (["--job-name", "my job"], "submit --job-name"),
        (["--job-name", "$(id)"], "submit --job-name"),
        (["--job-name", "1st"], "submit --job-name"),
        (["--account", "m4321;id"], "submit --account"),
        (["--partition", "debug\n#SBATCH --x"], "submit --partition/--queue"),
        (["--queue", "prod queue"], "submit --partition/--queue"),
        (["--time", "1:00"], "submit --time"),
        (["--time", "01:60:00"], "submit --time"),
        (["--time", "00:00:00"], "submit --time"),
        (["--time", "01:00:00\n"], "submit --time"),
        (["--job-name", "run\n"], "submit --job-name"),
        (["--nhosts", "100001"], "submit --nhosts"),  # 0 and below: argparse refuses them
        (["--max-jobs", "10001"], "submit --max-jobs"),
        (["--filesystems", "home:flare"], "submit --filesystems"),  # Slurm has none
        (["--scheduler", "pbs", "--filesystems", "home;flare"], "submit --filesystems"),
        (["--run-dir", "run dir"], "submit --run-dir"),  # in #SBATCH --output
    ],
)
def test_bad_options_are_one_line_usage_errors(monkeypatch, tmp_path, capsys, options, where):
    monkeypatch.chdir(tmp_path)
    argv = _submit_args(tmp_path / "run", "--scheduler", "slurm", *options)
    assert cli.main([*argv, "--", "goodput", "launch", "--", "true"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"goodput: error: {where}") and "; " in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("launch_line", "message"),
    [
        ([], "submit --: is followed by nothing, not a goodput launch line"),
        (["python", "train.py"], "is followed by python train.py, not a goodput launch line"),
        (["goodput", "train", "x.toml"], "not a goodput launch line"),
        (["goodput", "launch", "--timout", "60", "--", "true"], "does not know --timout"),
        (["goodput", "launch", "--timeout", "60"], "the goodput launch line names no command"),
        (["goodput", "launch", "--"], "the goodput launch line names no command"),
    ],
)
def test_the_launch_line_is_checked_before_anything_is_written(
    monkeypatch, tmp_path, capsys, launch_line, message
):
    monkeypatch.chdir(tmp_path)
    argv = _submit_args(tmp_path / "run", "--scheduler", "slurm")
    assert cli.main([*argv, "--", *launch_line]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert message in line
    assert not (tmp_path / "run").exists()


def test_a_different_existing_script_is_never_replaced(monkeypatch, tmp_path, capsys):
    line = ["goodput", "launch", "--", "true"]
    first = _write(monkeypatch, tmp_path, capsys, ["--scheduler", "slurm"], line)
    assert _write(monkeypatch, tmp_path, capsys, ["--scheduler", "slurm"], line) == first
    argv = _submit_args(tmp_path / "run", "--scheduler", "slurm", "--max-jobs", "3")
    assert cli.main([*argv, "--", *line]) == 2
    err = capsys.readouterr().err
    assert "chain.sbatch: exists and differs from the script these options give" in err
    assert "sbatch " in err and (tmp_path / "run" / "chain.sbatch").read_text() == first


def test_the_scheduler_is_the_one_installed(monkeypatch, tmp_path, capsys, stand_ins):
    bin_dir, _ = stand_ins
    monkeypatch.chdir(tmp_path)
    argv = [*_submit_args(tmp_path / "run"), "--", "goodput", "launch", "--", "true"]
    monkeypatch.setenv("PATH", str(bin_dir))  # qsub only
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "run" / "chain.pbs")
    monkeypatch.setenv("PATH", str(tmp_path))  # neither
    assert cli.main(argv) == 2
    assert (
        "neither sbatch nor qsub is on PATH; pass --scheduler slurm|pbs" in capsys.readouterr().err
    )
    (bin_dir / "sbatch").symlink_to(bin_dir / "qsub")
    monkeypatch.setenv("PATH", str(bin_dir))  # both
    assert cli.main(argv) == 2
    assert "both sbatch and qsub are on PATH" in capsys.readouterr().err


def test_submit_never_imports_torch(tmp_path):
    # It runs on login nodes, where importing torch takes seconds or is not possible at all.
    argv = [*_submit_args(tmp_path / "run", "--scheduler", "pbs"), "--", "goodput", "launch"]
    code = (
        "import sys; from goodput.cli import main; "
        f"rc = main({[*argv, '--', 'true']!r}); print('torch' in sys.modules, rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_child_env(), capture_output=True, text=True
    )
    assert result.stdout.splitlines()[-1] == "False 0", result.stderr


def test_submit_queues_job_1_and_prints_its_id(monkeypatch, tmp_path, capsys, stand_ins):
    bin_dir, log = stand_ins
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("SCHEDULER_LOG", str(log))
    monkeypatch.setenv("GOODPUT_CHAIN_JOB", "7")  # as inside a job of another chain
    monkeypatch.setenv("GOODPUT_CHAIN_PREVIOUS", "5,6")
    argv = [*_submit_args(tmp_path / "run", "--submit"), "--", "goodput", "launch", "--", "true"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == "42.pbs\n"
    script = str(tmp_path / "run" / "chain.pbs")
    # Job 1 of a new chain, with no jobs before it: the other chain's never count in this one.
    assert _events(log) == [["qsub", "-v", "GOODPUT_CHAIN_JOB", script, "1", None]]

    (tmp_path / "run" / "run.json").write_text("{}")  # what the trainer wrote first
    (tmp_path / "run" / "done").touch()
    assert cli.main(argv) == 2  # a finished run is not started again
    assert "done: exists: this run is complete" in capsys.readouterr().err
    assert len(_events(log)) == 1


# --- a PBS job, run by bash ----------------------------------------------------------------------


def _hydra_mpiexec() -> str | None:
    path = shutil.which("mpiexec")
    if path is None:
        return None
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return path if "HYDRA" in version else None


needs_hydra = pytest.mark.skipif(
    _hydra_mpiexec() is None, reason="needs MPICH's Hydra mpiexec (apt: mpich)"
)


def _run_pbs_job(
    tmp_path, stand_ins, script: Path, chain_job: str | None, job="41.pbs", previous=None
):
    """``bash SCRIPT`` as PBS would start job ``job`` of a chain: in the home folder, with PBS's
    variables and the chain's (``previous``: GOODPUT_CHAIN_PREVIOUS)."""
    bin_dir, log = stand_ins
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(f"{os.uname().nodename}\n")
    env = _child_env(PBS_JOBID=job, PBS_NODEFILE=str(nodefile), SCHEDULER_LOG=str(log))
    env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])
    if chain_job is not None:
        env["GOODPUT_CHAIN_JOB"] = chain_job
    if previous is not None:
        env["GOODPUT_CHAIN_PREVIOUS"] = previous
    return subprocess.run(
        ["bash", str(script)],
        cwd=Path.home(),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_hydra
@pytest.mark.parametrize(
    ("chain_job", "done_at", "code", "events", "returncode"),
    [
        (None, 0, 1, ["qsub", "run"], 1),  # the launch fails: the successor stays queued
        ("2", 1, 0, ["qsub", "run", "qdel"], 0),  # done: the queued successor is cancelled
        ("3", 0, 0, ["run"], 0),  # job 3 of --max-jobs 3 queues no successor
    ],
)
def test_a_pbs_job_queues_first_runs_the_launch_then_settles_the_successor(
    monkeypatch, tmp_path, capsys, stand_ins, chain_job, done_at, code, events, returncode
):
    _, log = stand_ins
    run_dir = tmp_path / "run"
    line = _run_line(log, run_dir, done_at, code, HOSTILE)
    _write(monkeypatch, tmp_path, capsys, ["--scheduler", "pbs", "--max-jobs", "3"], line)
    result = _run_pbs_job(tmp_path, stand_ins, run_dir / "chain.pbs", chain_job)
    assert result.returncode == returncode, result.stdout + result.stderr
    recorded = _events(log)
    assert [event[0] for event in recorded] == events
    assert ["run", *HOSTILE] in recorded  # every argument arrived as it was written
    assert not list(tmp_path.rglob("PWNED")) and not (Path.home() / "PWNED").exists()
    if "qsub" in events:
        next_job = str(int(chain_job or "1") + 1)
        script = str(run_dir / "chain.pbs")
        qsub = ["qsub", "-W", "depend=afterany:41.pbs", "-v", "GOODPUT_CHAIN_JOB", script]
        assert recorded[0] == [*qsub, next_job, "41.pbs"]  # the successor knows this job
    if "qdel" in events:
        assert recorded[-1] == ["qdel", "42.pbs", chain_job, None]
    if chain_job == "3":
        assert "job 3 of 3 (--max-jobs): the last one" in result.stdout
        assert "the chain ends without" in result.stderr


def test_a_pbs_job_of_a_finished_run_does_nothing(monkeypatch, tmp_path, capsys, stand_ins):
    _, log = stand_ins
    run_dir = tmp_path / "run"
    _write(monkeypatch, tmp_path, capsys, ["--scheduler", "pbs"], _run_line(log, run_dir, 0))
    (run_dir / "done").touch()
    result = _run_pbs_job(tmp_path, stand_ins, run_dir / "chain.pbs", "2")
    assert result.returncode == 0, result.stderr
    assert "the run is complete; nothing to do" in result.stdout
    assert _events(log) == []


@pytest.mark.parametrize("chain_job", ["a[$(touch PWNED)]", "0", "1\n", "x"])
def test_a_job_refuses_a_chain_position_that_is_not_a_number(
    monkeypatch, tmp_path, capsys, stand_ins, chain_job
):
    # bash arithmetic would evaluate the first one, running the $(...) inside it.
    _, log = stand_ins
    run_dir = tmp_path / "run"
    _write(monkeypatch, tmp_path, capsys, ["--scheduler", "pbs"], _run_line(log, run_dir, 0))
    result = _run_pbs_job(tmp_path, stand_ins, run_dir / "chain.pbs", chain_job)
    assert result.returncode == 2 and "is not a job number; unset it" in result.stderr
    assert _events(log) == [] and not list(tmp_path.rglob("PWNED"))
    assert not (Path.home() / "PWNED").exists()


# --- the guard: two jobs in a row without a step end the chain ----------------------------------


def _attempts(path: Path) -> list[tuple[str, int]]:
    return [(r.job, r.steps_gained) for r in read_attempts(path)]


@needs_hydra
@pytest.mark.parametrize("launch_dir", [True, False])
def test_a_pbs_chain_that_cannot_start_ends_after_two_jobs_and_a_new_one_starts(
    monkeypatch, tmp_path, capsys, stand_ins, launch_dir
):
    # A command that fails at once, as a job that cannot start does. Without --run-dir on the
    # launch line each job logs its attempts into ./launch-JOBID of the folder submitted from
    # (the script cds there), and the guard looks there.
    _, log = stand_ins
    run_dir = tmp_path / "run"
    line = _run_line(log, run_dir, 0, code=5, step=False, launch_dir=launch_dir)
    _write(monkeypatch, tmp_path, capsys, ["--scheduler", "pbs"], line)
    script = run_dir / "chain.pbs"

    first = _run_pbs_job(tmp_path, stand_ins, script, None, job="41.pbs")
    assert first.returncode == 1, first.stderr  # goodput launch's code for the command's 5
    assert "job 1 of at most 10; job 42.pbs is queued to go on" in first.stdout
    second = _run_pbs_job(tmp_path, stand_ins, script, "2", job="42.pbs", previous="41.pbs")
    assert second.returncode == 1
    (reason,) = [line for line in second.stderr.splitlines() if "gained no step" in line]
    attempts = (run_dir / "launch" if launch_dir else tmp_path / "launch-42.pbs") / "attempts.jsonl"
    assert reason == (
        "goodput chain: jobs 41.pbs and 42.pbs: 2 jobs in a row gained no step (41.pbs: 1 "
        "attempt(s), the last exited 5 (stuck-pre-training, no retries left); 42.pbs: 1 "
        "attempt(s), the last exited 5 (stuck-pre-training, no retries left)); the chain ends "
        "here; fix what their logs show, then start a new chain with goodput submit --submit"
    )
    assert "job 2: job 43.pbs cancelled" in second.stderr
    assert "job 2: the launch exited 1; the chain ends here" in second.stderr
    qsubs = [event for event in _events(log) if event[0] == "qsub"]
    assert [event[-2:] for event in qsubs] == [["2", "41.pbs"], ["3", "41.pbs,42.pbs"]]
    assert [event[0] for event in _events(log)] == ["qsub", "run", "qsub", "run", "qdel"]
    assert _events(log)[-1][:2] == ["qdel", "43.pbs"]
    if launch_dir:
        assert _attempts(attempts) == [("41.pbs", 0), ("42.pbs", 0)]
    else:
        assert _attempts(attempts) == [("42.pbs", 0)]

    # Had job 3 started anyway (job 2 killed before it could cancel it), it stops before it
    # queues or runs anything.
    third = _run_pbs_job(tmp_path, stand_ins, script, "3", job="43.pbs", previous="41.pbs,42.pbs")
    assert third.returncode == 1
    assert "2 jobs in a row gained no step" in third.stderr
    assert "job 3: the chain ends here, before its launch" in third.stderr
    assert len(_events(log)) == 5

    # A new chain from the same script, as goodput submit --submit starts it after a fix: its
    # first two jobs run their launch whatever the old chain's did (here they fail once more,
    # and only then does the new chain end).
    log.unlink()
    new_first = _run_pbs_job(tmp_path, stand_ins, script, "1", job="50.pbs")
    assert new_first.returncode == 1 and "job 1: the launch exited 1; job 42.pbs goes on" in (
        new_first.stdout
    )
    assert _events(log)[0][-2:] == ["2", "50.pbs"]
    new_second = _run_pbs_job(tmp_path, stand_ins, script, "2", job="51.pbs", previous="50.pbs")
    assert "jobs 50.pbs and 51.pbs: 2 jobs in a row gained no step" in new_second.stderr
    assert [event[0] for event in _events(log)] == ["qsub", "run", "qsub", "run", "qdel"]


@needs_hydra
def test_the_eval_gates_stop_ends_the_chain(monkeypatch, tmp_path, capsys, stand_ins):
    """A run the eval gate stopped (exit 3) is not learning: its next job would resume into the
    same state, so the job cancels it and the chain ends with the gate's code."""
    _, log = stand_ins
    run_dir = tmp_path / "run"
    _write(monkeypatch, tmp_path, capsys, ["--scheduler", "pbs"], _run_line(log, run_dir, 0, 3))
    result = _run_pbs_job(tmp_path, stand_ins, run_dir / "chain.pbs", None, job="41.pbs")
    assert result.returncode == 3, result.stderr
    assert "job 1: the eval gate stopped the run (exit 3); the chain ends here" in result.stderr
    assert [event[0] for event in _events(log)] == ["qsub", "run", "qdel"]
    assert _events(log)[-1][:2] == ["qdel", "42.pbs"]


@needs_hydra
def test_a_job_that_gains_a_step_keeps_the_chain_going(monkeypatch, tmp_path, capsys, stand_ins):
    _, log = stand_ins
    run_dir = tmp_path / "run"
    line = _run_line(log, run_dir, 0, code=0, step=True)
    _write(monkeypatch, tmp_path, capsys, ["--scheduler", "pbs"], line)
    # The job before made no step (nothing recorded for it at all); this one makes one.
    result = _run_pbs_job(tmp_path, stand_ins, run_dir / "chain.pbs", "5", "41.pbs", "39.pbs")
    assert result.returncode == 0, result.stderr
    assert "job 5: the launch exited 0; job 42.pbs goes on" in result.stdout
    assert [event[0] for event in _events(log)] == ["qsub", "run"]
    assert _events(log)[0][-2:] == ["6", "39.pbs,41.pbs"]
    assert _attempts(run_dir / "launch" / "attempts.jsonl") == [("41.pbs", 1)]


@needs_hydra
def test_jobs_that_left_no_attempt_count_as_stepless(monkeypatch, tmp_path, capsys, stand_ins):
    # Their launch line never ran an attempt (say, goodput was not on the compute nodes' PATH).
    _, log = stand_ins
    run_dir = tmp_path / "run"
    _write(monkeypatch, tmp_path, capsys, ["--scheduler", "pbs"], _run_line(log, run_dir, 0))
    result = _run_pbs_job(
        tmp_path, stand_ins, run_dir / "chain.pbs", "3", "43.pbs", "41.pbs,42.pbs"
    )
    assert result.returncode == 1
    attempts = run_dir / "launch" / "attempts.jsonl"
    assert f"41.pbs: no launch attempt in {attempts}, so its launch line failed first" in (
        result.stderr
    )
    assert _events(log) == []


@pytest.mark.parametrize(
    "previous",
    ["$(touch PWNED)", "1,2,3", "1,,2", "-h", "--launch-run-dir=/", "a b", "1\n2", ",", "x" * 200],
)
def test_a_job_refuses_previous_jobs_that_are_not_job_ids(
    monkeypatch, tmp_path, capsys, stand_ins, previous
):
    _, log = stand_ins
    run_dir = tmp_path / "run"
    _write(monkeypatch, tmp_path, capsys, ["--scheduler", "pbs"], _run_line(log, run_dir, 0))
    result = _run_pbs_job(tmp_path, stand_ins, run_dir / "chain.pbs", "2", previous=previous)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "goodput chain: GOODPUT_CHAIN_PREVIOUS: " in result.stderr
    assert "is not up to 2 job ids separated by commas; unset it" in result.stderr
    assert _events(log) == [] and not list(tmp_path.rglob("PWNED"))
    assert not (Path.home() / "PWNED").exists()


def test_a_damaged_attempts_log_ends_the_chain_naming_its_line(
    monkeypatch, tmp_path, capsys, stand_ins
):
    _, log = stand_ins
    run_dir = tmp_path / "run"
    _write(monkeypatch, tmp_path, capsys, ["--scheduler", "pbs"], _run_line(log, run_dir, 0))
    attempts = run_dir / "launch" / "attempts.jsonl"
    attempts.parent.mkdir(parents=True)
    attempts.write_text('{"attempt": 1}\n')
    result = _run_pbs_job(
        tmp_path, stand_ins, run_dir / "chain.pbs", "3", "43.pbs", "41.pbs,42.pbs"
    )
    assert result.returncode == 1
    assert f"goodput chain: {attempts}:1: " in result.stderr and "move it aside" in result.stderr
    assert _events(log) == []


# --- real Slurm chains -------------------------------------------------------------------------


def _slurm_up() -> bool:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        result = subprocess.run(
            ["sinfo", "-h", "-t", "idle,mix,alloc", "-o", "%N"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0 and bool(result.stdout.split())


needs_slurm = pytest.mark.skipif(
    not _slurm_up(),
    reason="needs a running Slurm with a usable node (apt: slurm-wlm munge; .ci/start-slurm)",
)


def _jobs(name: str, *states: str) -> list[tuple[int, str]]:
    """(id, state) of this chain's jobs, in submission order: queued ones, or all with 'all'."""
    argv = ["squeue", "-h", "-n", name, "-o", "%i %T", *(["-t", *states] if states else [])]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=10).stdout
    return sorted(
        (int(job_id), state) for job_id, state in (row.split() for row in out.splitlines())
    )


def _slurm_chain(tmp_path: Path, max_jobs: int, done_at: int):
    """Submit a real chain running RUN; wait until none of its jobs is queued or running."""
    name = f"chain-{uuid.uuid4().hex[:8]}"
    run_dir, log = tmp_path / "run", tmp_path / "events.jsonl"
    options = ["--submit", "--max-jobs", str(max_jobs), "--job-name", name]
    argv = _submit_args(run_dir, "--scheduler", "slurm", *options, nhosts="1", time="00:02:00")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "goodput", *argv, "--", *_run_line(log, run_dir, done_at)],
            cwd=tmp_path,
            env=_child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        deadline = time.monotonic() + CHAIN_TIMEOUT_S
        while _jobs(name):
            assert time.monotonic() < deadline, f"chain still queued: {_jobs(name)}"
            time.sleep(0.5)
    finally:  # after a failure, cancel what is left of this chain
        if leftover := [str(job_id) for job_id, _ in _jobs(name)]:
            subprocess.run(["scancel", *leftover], check=False)
    jobs = _jobs(name, "all")
    assert jobs[0][0] == int(result.stdout)  # the printed id is job 1's
    logs = [(run_dir / f"{name}-{job_id}.out") for job_id, _ in jobs]
    return jobs, [path.read_text() if path.exists() else None for path in logs], _events(log)


@needs_slurm
def test_a_slurm_chain_stops_once_the_run_writes_done(tmp_path):
    jobs, logs, events = _slurm_chain(tmp_path, max_jobs=3, done_at=2)
    assert [state for _, state in jobs] == ["COMPLETED", "COMPLETED", "CANCELLED"]
    assert events == [["run"], ["run"]]
    assert f"job 1 of at most 3; job {jobs[1][0]} is queued to go on" in logs[0]
    assert f"job 2 of at most 3; job {jobs[2][0]} is queued to go on" in logs[1]
    assert "job 2: " in logs[1] and "done written, the run is complete" in logs[1]
    assert logs[2] is None  # cancelled while it waited: it never started


@needs_slurm
def test_a_slurm_chain_without_done_stops_after_max_jobs(tmp_path):
    jobs, logs, events = _slurm_chain(tmp_path, max_jobs=2, done_at=0)
    assert [state for _, state in jobs] == ["COMPLETED", "COMPLETED"]
    assert events == [["run"], ["run"]]
    assert "job 2 of 2 (--max-jobs): the last one" in logs[1]
    assert "the chain ends without" in logs[1]


@pytest.mark.parametrize(
    ("launch", "train", "message"),
    [
        (
            ["--nhosts", "1", "--ppn", "8"],
            [],
            "llama-8b.toml: [data] file_list is not set; add data.file_list=PATH",
        ),
        (
            ["--nhosts", "1", "--ppn", "4"],
            ["data.file_list=corpora.txt"],
            "llama-8b.toml [parallel]: dp_replicate 1 x dp_shard 8 x tp 1 x pp 1 x cp 1 = 8 "
            "ranks, but the world has 4",
        ),
        (["--nhosts", "1", "--ppn", "8"], ["data.file_list=x", "--bogus"], "does not know --bogus"),
    ],
)
def test_a_train_line_no_job_could_start_is_refused_before_anything_is_written(
    monkeypatch, tmp_path, capsys, launch, train, message
):
    monkeypatch.chdir(tmp_path)
    line = ["goodput", "launch", *launch, "--", "goodput", "train", str(CONFIGS / "llama-8b.toml")]
    argv = [*_submit_args(tmp_path / "run", "--scheduler", "slurm"), "--", *line, *train]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "run").exists()


def test_a_recipes_chain_is_checked_without_torch(tmp_path):
    """The 405B recipe (a pipeline) on its machine: loaded and checked on a login node."""
    line = ["goodput", "launch", "--profile", "polaris", "--nhosts", "1024", "--ppn", "8", "--"]
    line += ["goodput", "train", str(CONFIGS / "llama-405b.toml"), "data.file_list=corpora.txt"]
    argv = [*_submit_args(tmp_path / "run", "--scheduler", "pbs", nhosts="1031"), "--", *line]
    code = (
        "import sys; from goodput.cli import main; "
        f"rc = main({argv!r}); print('torch' in sys.modules, rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_child_env(), capture_output=True, text=True
    )
    assert result.stdout.splitlines()[-1] == "False 0", result.stderr
