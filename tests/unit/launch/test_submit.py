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
from goodput.testing.jobs import outside_any_job

BIN = Path(sys.executable).parent  # this venv's bin: the jobs' `goodput` is found here
CHAIN_TIMEOUT_S = 90
HOSTILE = ["$(touch PWNED)", ";", "a'b\"c", "`touch PWNED`", "$HOME", "x && touch PWNED"]

# The command a chain runs: it appends ["run", *EXTRA] to LOG (the file the stand-ins write to as
# well, so the log shows the order of events) and writes DONE on the DONE_AT-th run (0: never).
RUN = """\
import json, sys
log, done, done_at, code, *extra = sys.argv[1:]
with open(log, "a") as f:
    f.write(json.dumps(["run", *extra]) + "\\n")
with open(log) as f:
    runs = sum(json.loads(line)[0] == "run" for line in f)
if runs == int(done_at):
    open(done, "w").close()
sys.exit(int(code))
"""

# Records its name, argv and chain position; qsub prints a job id as the real one does.
STAND_IN = f"""\
#!{sys.executable}
import json, os, sys
name = os.path.basename(sys.argv[0])
with open(os.environ["SCHEDULER_LOG"], "a") as f:
    f.write(json.dumps([name, *sys.argv[1:], os.environ.get("GOODPUT_CHAIN_JOB")]) + "\\n")
if name == "qsub":
    print("42.pbs")
"""


def _run_line(log: Path, run_dir: Path, done_at: int, code: int = 0, extra=()) -> list[str]:
    """The launch line: goodput launch running RUN."""
    command = [sys.executable, "-c", RUN, str(log), str(run_dir / "done"), str(done_at), str(code)]
    return ["goodput", "launch", "--run-dir", str(run_dir / "launch"), "--", *command, *extra]


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
    line = ["goodput", "launch", "--timeout", "1800", "--", "goodput", "train", "run.toml"]
    options = ["--scheduler", "slurm", "--account", "m4321", "--partition", "regular"]
    script = _write(monkeypatch, tmp_path, capsys, [*options, "--max-jobs", "4"], line)
    run_dir = tmp_path / "run"
    assert script.splitlines()[:7] == [
        "#!/bin/bash",
        "#SBATCH --job-name=run",
        "#SBATCH --nodes=2",
        "#SBATCH --time=01:00:00",
        f"#SBATCH --output={run_dir}/%x-%j.out",
        "#SBATCH --account=m4321",
        "#SBATCH --partition=regular",
    ]
    assert "set -euo pipefail\n" in script and f"cd {tmp_path}\n" in script
    assert f"done_marker={run_dir}/done\n" in script and "max_jobs=4\n" in script
    assert (
        'sbatch --dependency=afterany:"$SLURM_JOB_ID" --parsable --export=ALL,GOODPUT_CHAIN_JOB '
        '"$script"' in script
    )
    assert 'scancel "$next"' in script and "exec " not in script
    # The successor is queued before the launch runs, and the launch is waited for.
    assert script.index("sbatch --dep") < script.index("goodput launch") < script.index("scancel")
    assert _launch_argv(script) == line
    subprocess.run(["bash", "-n", run_dir / "chain.sbatch"], check=True)


def test_old_nodes_spelling_writes_the_same_script_with_one_warning(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
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
    script = _write(monkeypatch, tmp_path, capsys, options, ["goodput", "launch", "--", "true"])
    assert script.splitlines()[:11] == [
        "#!/bin/bash",
        "#PBS -N llama-20b",
        "#PBS -l select=2",
        "#PBS -l place=scatter",
        "#PBS -l walltime=01:00:00",
        "#PBS -l filesystems=home:flare",
        "#PBS -A AuroraGPT",
        "#PBS -q prod",
        "#PBS -j oe",
        "#PBS -V",
        "# Written by `goodput submit`: one job of a chain that reruns the launch line below "
        "until the",
    ]
    assert 'qsub -W depend=afterany:"$PBS_JOBID" -v GOODPUT_CHAIN_JOB "$script"' in script
    assert 'qdel "$next"' in script and "max_jobs=10\n" in script
    subprocess.run(["bash", "-n", tmp_path / "run" / "chain.pbs"], check=True)


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
    argv = [*_submit_args(tmp_path / "run", "--submit"), "--", "goodput", "launch", "--", "true"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == "42.pbs\n"
    script = str(tmp_path / "run" / "chain.pbs")
    assert _events(log) == [["qsub", "-v", "GOODPUT_CHAIN_JOB", script, "1"]]

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


def _run_pbs_job(tmp_path, stand_ins, script: Path, chain_job: str | None):
    """``bash SCRIPT`` as PBS would start it: in the home folder, with PBS's variables."""
    bin_dir, log = stand_ins
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(f"{os.uname().nodename}\n")
    env = _child_env(PBS_JOBID="41.pbs", PBS_NODEFILE=str(nodefile), SCHEDULER_LOG=str(log))
    env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])
    if chain_job is not None:
        env["GOODPUT_CHAIN_JOB"] = chain_job
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
        assert recorded[0] == [*qsub, next_job]
    if "qdel" in events:
        assert recorded[-1] == ["qdel", "42.pbs", chain_job]
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
