"""Launch plans and command lines, from faked scheduler environments: no cluster needed.

``read_placement`` is a pure function of an environment mapping and the PBS host file's text, so
Slurm and PBS allocations are plain dicts and strings here, and the srun/mpiexec argv lists are
compared exactly, never run. The local launcher is run for real, as a child process.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from goodput import cli
from goodput.errors import GoodputError
from goodput.launch.env import read_placement
from goodput.launch.launchers import (
    BUILDERS,
    PROFILE_DIR,
    build_processes,
    format_processes,
    load_profile,
    plan_launch,
    profile_names,
    write_hostfile,
)
from goodput.testing.jobs import outside_any_job

REPO = Path(__file__).resolve().parents[3]
COMMAND = ["python", "train.py", "--steps", "10"]
SLURM = {"SLURM_JOB_ID": "812", "SLURM_JOB_NODELIST": "nid[001-003]"}
PBS = {"PBS_JOBID": "42.aurora-pbs"}
PBS_NODEFILE = "x4102c0s0b0n0\nx4102c0s0b0n0\nx4102c0s1b0n0\nx4102c0s2b0n0\n"
SCHEDULER_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "PBS_JOBID", "PBS_NODEFILE")


def _plan(env, hostfile=None, profile="generic", run_dir=Path("/runs/a"), **counts):
    return plan_launch(
        read_placement(env, hostfile), load_profile(profile), run_dir=run_dir, **counts
    )


def _one(plan, env=None):
    (spec,) = build_processes(plan, COMMAND, env or {})
    return spec


@pytest.fixture
def local_env(monkeypatch, tmp_path):
    """This process as if outside any job, in an empty working directory."""
    for name in (*SCHEDULER_VARS, "GOODPUT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


def test_srun_reads_the_exact_host_set_from_the_host_file_and_counts():
    plan = _plan(SLURM, nhosts=2, ppn=4)
    spec = _one(plan, {"PATH": "/bin"})
    assert spec.argv == [
        "srun",
        "--nodes",
        "2",
        "--ntasks",
        "8",
        "--ntasks-per-node",
        "4",
        "--nodelist",
        "/runs/a/" + plan.hostfile.name,  # a '/': srun reads the names from the file
        "--kill-on-bad-exit=1",
        *COMMAND,
    ]
    assert plan.spares == ("nid003",)
    port = read_placement(SLURM).master_port
    # The whole environment is handed over: srun forwards it to the tasks.
    assert spec.env == {
        "PATH": "/bin",
        "MASTER_ADDR": "nid001",
        "MASTER_PORT": str(port),
        "GOODPUT_HOSTFILE": str(plan.hostfile),
        "LOCAL_WORLD_SIZE": "4",
    }


def test_srun_with_the_perlmutter_profile():
    plan = _plan(SLURM, profile="perlmutter", nhosts=1)
    spec = _one(plan)
    assert spec.argv == [
        "srun",
        "--nodes",
        "1",
        "--ntasks",
        "4",
        "--ntasks-per-node",
        "4",
        "--nodelist",
        str(plan.hostfile),
        "--kill-on-bad-exit=1",
        "--cpu-bind=cores",
        "--gpus-per-node=4",
        "--cpus-per-task=32",
        "--gpu-bind=none",
        *COMMAND,
    ]
    assert spec.env["FI_MR_CACHE_MONITOR"] == "userfaultfd"


def test_mpiexec_hydra_reads_a_host_file_of_the_active_hosts(tmp_path):
    plan = _plan(PBS, PBS_NODEFILE, run_dir=tmp_path, nhosts=2, ppn=2)
    spec = _one(plan)
    port = read_placement(PBS, PBS_NODEFILE).master_port
    assert spec.argv == [
        "mpiexec",
        "-n",
        "4",
        "-ppn",
        "2",
        "-hostfile",
        str(plan.hostfile),
        "-genv",
        "MASTER_ADDR",
        "x4102c0s0b0n0",
        "-genv",
        "MASTER_PORT",
        str(port),
        "-genv",
        "GOODPUT_HOSTFILE",
        str(plan.hostfile),
        "-genv",
        "LOCAL_WORLD_SIZE",
        "2",
        *COMMAND,
    ]
    assert plan.hostfile.parent == tmp_path and not plan.hostfile.exists()
    assert write_hostfile(plan) == plan.hostfile
    assert plan.hostfile.read_text() == "x4102c0s0b0n0\nx4102c0s1b0n0\n"  # the spare is not in it


def test_mpiexec_pals_with_the_aurora_profile(tmp_path):
    plan = _plan(PBS, PBS_NODEFILE, profile="aurora", run_dir=tmp_path)
    argv = _one(plan).argv
    assert argv[:9] == [
        "mpiexec",
        "--np",
        "36",
        "--ppn",
        "12",
        "--hostfile",
        str(plan.hostfile),
        "--cpu-bind",
        "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100",
    ]
    env_flags = [f"--env={item}" for item in plan.profile.env]
    env_flags += ["--env=MASTER_ADDR=x4102c0s0b0n0", f"--env=MASTER_PORT={plan.master_port}"]
    env_flags += [f"--env=GOODPUT_HOSTFILE={plan.hostfile}", "--env=LOCAL_WORLD_SIZE=12"]
    pairs = zip(argv[9:-4:2], argv[10:-4:2], strict=True)
    assert [f"{flag}={value}" for flag, value in pairs] == env_flags
    assert argv[-4:] == COMMAND
    assert "CCL_PROCESS_LAUNCHER=pmix" in plan.profile.env


def test_mpiexec_forwards_the_profile_pass_env_names_that_are_set(tmp_path):
    profile = tmp_path / "site.toml"
    profile.write_text('ppn = 2\npass_env = ["HF_HOME", "UNSET_HERE"]\nenv = ["A=1 2"]\n')
    plan = _plan(PBS, PBS_NODEFILE, profile=str(profile), run_dir=tmp_path, nhosts=1)
    argv = _one(plan, {"HF_HOME": "/hf"}).argv
    assert argv[7:13] == ["-genvlist", "HF_HOME", "-genv", "A", "1 2", "-genv"]
    assert plan.profile.name == "site"


def _placements(scheduler):
    """Two allocations of the same size on different hosts."""
    if scheduler == "slurm":
        return [read_placement({**SLURM, "SLURM_JOB_NODELIST": f"{n}[1-2]"}) for n in "ab"]
    if scheduler == "pbs":
        return [read_placement(PBS, f"{n}1\n{n}2\n") for n in "ab"]
    local = read_placement({})
    return [local, dataclasses.replace(local, hosts=("elsewhere",))]


@pytest.mark.parametrize("scheduler", sorted(BUILDERS))
def test_two_host_sets_never_give_the_same_command(scheduler, tmp_path):
    # A launcher that ignored its host set would rerun on the same (bad) hosts after a swap.
    commands = []
    for placement in _placements(scheduler):
        plan = plan_launch(placement, load_profile("generic"), run_dir=tmp_path)
        try:
            specs = build_processes(plan, COMMAND, {})
        except GoodputError as error:
            assert "cannot start ranks on elsewhere" in str(error)  # local: this host or nothing
            continue
        commands.append([spec.argv for spec in specs])
    assert len(commands) == 1 or commands[0] != commands[1]


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ({"nhosts": 4}, "4 hosts asked for, 3 in the slurm allocation; ask for 1 to 3"),
        ({"nhosts": 0}, "0 hosts asked for"),
        ({"nhosts": 2, "ppn": 4, "nproc": 3}, "3 ranks do not fit 2 hosts x 4"),
        ({"nhosts": 2, "ppn": 4, "nproc": 9}, "use --nproc from 5 to 8"),
        ({"ppn": 0}, "--ppn: 0 is not a count"),
    ],
)
def test_impossible_counts_are_usage_errors(counts, message):
    with pytest.raises(GoodputError, match=message) as caught:
        _plan(SLURM, **counts)
    assert caught.value.code == 2 and "\n" not in caught.value.render()


def test_nproc_alone_spreads_over_the_hosts():
    plan = _plan(SLURM, profile="frontier", nproc=6)
    assert (len(plan.hosts), plan.ppn, plan.nproc) == (3, 2, 6)
    assert _plan(SLURM, profile="frontier").nproc == 24  # the profile's 8 per node


@pytest.mark.parametrize(
    ("env", "hostfile"),
    [
        ({**SLURM, "SLURM_JOB_NODELIST": "nid001,nid002;reboot"}, None),
        (PBS, "x1\n-oProxyCommand=evil\n"),
    ],
)
def test_invalid_host_names_are_refused(env, hostfile):
    with pytest.raises(GoodputError, match="not a valid host name"):
        _plan(env, hostfile)


def test_a_plan_never_takes_an_unchecked_host():
    placement = dataclasses.replace(read_placement(SLURM), hosts=("ok1", "$(rm -rf ~)"))
    with pytest.raises(GoodputError, match="not a valid host name"):
        plan_launch(placement, load_profile("generic"), run_dir=Path("."))


def test_too_many_hosts_from_the_command_line_is_one_line(monkeypatch, tmp_path, capsys):
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["launch", "--nhosts", "5", "--dry-run", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("goodput: error: --nhosts: 5 hosts asked for")


def test_a_missing_command_is_a_usage_error(local_env, capsys):
    assert cli.main(["launch", "--nproc", "2", "--dry-run"]) == 2
    assert "no command to run" in capsys.readouterr().err


def test_local_dry_run_lists_one_line_per_rank(local_env, capsys):
    argv = ["launch", "--dry-run", "--nproc", "3", "--", "python", "-c", "print('hi there')"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    ranks = []
    for line in lines:
        words = shlex.split(line)
        assignments = dict(word.split("=", 1) for word in words[:8])
        assert words[8:] == ["python", "-c", "print('hi there')"]
        hostfile = Path(assignments["GOODPUT_HOSTFILE"])  # named, not written: a dry run
        assert hostfile.parent == Path.cwd() / "launch-local" and hostfile.is_absolute()
        assert int(assignments["OMP_NUM_THREADS"]) >= 1  # each rank its share of the cores
        assert assignments["WORLD_SIZE"] == assignments["LOCAL_WORLD_SIZE"] == "3"
        assert assignments["MASTER_ADDR"] == "127.0.0.1"
        ranks.append((assignments["RANK"], assignments["LOCAL_RANK"]))
    assert ranks == [("0", "0"), ("1", "1"), ("2", "2")]
    assert not list(Path.cwd().iterdir())  # a dry run writes nothing


def test_format_shows_only_what_the_launcher_adds():
    plan = _plan(SLURM, nhosts=1, ppn=1)
    (line,) = format_processes(
        build_processes(plan, ["echo", "a b"], {"HOME": "/h"}), {"HOME": "/h"}
    )
    assert line == (
        f"MASTER_ADDR=nid001 MASTER_PORT={plan.master_port} GOODPUT_HOSTFILE={plan.hostfile} "
        "LOCAL_WORLD_SIZE=1 srun --nodes 1 --ntasks 1 "
        f"--ntasks-per-node 1 --nodelist {plan.hostfile} --kill-on-bad-exit=1 echo 'a b'"
    )


def test_the_profile_comes_from_goodput_profile(local_env, monkeypatch, capsys):
    monkeypatch.setenv("GOODPUT_PROFILE", "frontier")
    assert cli.main(["launch", "--dry-run", "--", "true"]) == 0
    captured = capsys.readouterr()
    assert "profile frontier" in captured.err
    assert "MIOPEN_USER_DB_PATH=/tmp/my-miopen-cache" in captured.out


def test_local_ranks_really_run(tmp_path):
    code = "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])"
    result = subprocess.run(
        [sys.executable, "-m", "goodput.cli", "launch", "--nproc", "2", "--"]
        + [sys.executable, "-c", code],
        cwd=tmp_path,
        env=outside_any_job(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[rank0] rank 0 of 2", "[rank1] rank 1 of 2"]
    (record,) = (tmp_path / "launch-local" / "attempts.jsonl").read_text().splitlines()
    assert json.loads(record)["exit_code"] == 0


def _hydra_mpiexec():
    path = shutil.which("mpiexec")
    if path is None:
        return None
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return path if "HYDRA" in version else None


@pytest.mark.skipif(_hydra_mpiexec() is None, reason="needs MPICH's Hydra mpiexec (apt: mpich)")
def test_pbs_ranks_really_run_under_hydra(tmp_path):
    """A faked PBS job on this host: the generic profile's Hydra flags, run by real mpiexec."""
    (tmp_path / "nodefile").write_text(f"{socket.gethostname()}\n")
    (tmp_path / "site.toml").write_text('pass_env = ["SITE_DATA"]\nenv = ["GREETING=hi there"]\n')
    code = (
        "import os; from goodput.ranks import every_rank_host; e = os.environ; "
        "open(f\"rank{e['PMI_RANK']}\", 'w').write(' '.join("
        "[e['GREETING'], e['SITE_DATA'], e['MASTER_ADDR'], e['MASTER_PORT'], "
        "*every_rank_host(2, e)]))"
    )
    env = {**outside_any_job(), "PBS_JOBID": "7.pbs", "PBS_NODEFILE": str(tmp_path / "nodefile")}
    result = subprocess.run(
        [sys.executable, "-m", "goodput.cli", "launch", "--profile", "./site.toml"]
        + ["--nproc", "2", "--timeout", "60", "--", sys.executable, "-c", code],
        cwd=tmp_path,
        env={**env, "SITE_DATA": "/data"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    port = read_placement(env, "x\n").master_port
    for rank in (0, 1):
        said = (tmp_path / f"rank{rank}").read_text()
        host = socket.gethostname()  # every rank's, from the launcher's host file
        assert said == f"hi there /data {host} {port} {host.split('.')[0]} {host.split('.')[0]}"
    assert [p.name for p in (tmp_path / "launch-7.pbs").glob("hostfile-*")]


def test_every_shipped_profile_parses():
    assert profile_names() == ["aurora", "frontier", "generic", "perlmutter", "polaris"]
    for name in profile_names():
        profile = load_profile(name)
        assert profile.name == name and profile.description
        for env, hostfile in ((SLURM, None), (PBS, PBS_NODEFILE)):
            plan = plan_launch(read_placement(env, hostfile), profile, run_dir=Path("/r"))
            assert build_processes(plan, COMMAND, {})[0].argv[-4:] == COMMAND


def test_profiles_ship_with_the_package():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["goodput.launch"]
    shipped = {path for pattern in patterns for path in PROFILE_DIR.parent.glob(pattern)}
    assert shipped == set(PROFILE_DIR.glob("*.toml")) and shipped


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name = "x"\n', "a profile has no 'name' key"),
        ('env = ["NO_EQUALS"]\n', "is not NAME=VALUE"),
        ('mpiexec = "openmpi"\n', "is not allowed"),
        ("ppn = 0\n", r"'ppn' = 0 is not in \[1, 1024\]"),
        ("cores = 4\n", "unknown key 'cores'"),
    ],
)
def test_bad_profiles_are_named(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(GoodputError, match=message):
        load_profile(str(path))


def test_an_unknown_profile_lists_the_valid_ones():
    with pytest.raises(GoodputError, match="use one of aurora, frontier, generic, perlmutter"):
        load_profile("summit")


def test_launch_dry_run_never_imports_torch(tmp_path):
    code = (
        "import sys; from goodput.cli import main; "
        "rc = main(['launch', '--dry-run', '--nproc', '2', '--', 'true']); "
        "print('torch' in sys.modules, rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=outside_any_job(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.splitlines()[-1] == "False 0"
