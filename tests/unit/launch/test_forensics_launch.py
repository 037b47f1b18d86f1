"""Hang forensics as the launcher runs them: the beacon folder of each attempt and what of it is
deleted, the command that reaches each host (srun --overlap, mpiexec) and a host's answer bounded
in time and size, the idle hook of an attempt (before the stop, bounded), the profiles' device
probes, and a real ``goodput launch`` of a 2-rank ``goodput train`` that hangs twice — once on an
injected stall in the data phase, once on a rank the test SIGSTOPs from outside — naming the
rank, its host and its phase in the attempt line and in ``attempts.jsonl``."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from goodput import beacon, rundir
from goodput.config import to_toml
from goodput.errors import GoodputError
from goodput.launch import beacon_folder, forensics
from goodput.launch.attempt import AttemptResult, ProcessSpec, run_attempt
from goodput.launch.env import read_placement
from goodput.launch.fanout import run_bounded
from goodput.launch.history import Evidence, read_attempts
from goodput.launch.launchers import (
    build_host_command,
    load_profile,
    plan_launch,
    profile_names,
)
from goodput.testing.jobs import launched_rank_pids, outside_any_job
from goodput.testing.tiny import tiny_run_config

REPO = Path(__file__).resolve().parents[3]
ARGV = ["python", "-m", "goodput.launch.forensics", "collect", "--dir", "/dev/shm/x"]

# --- the beacon folders -------------------------------------------------------------------------


def test_each_attempt_gets_a_private_folder_under_the_launch_folder(tmp_path):
    launch = beacon_folder.launch_folder("812", base=tmp_path)
    assert launch == tmp_path / f"goodput-{os.getuid()}-812-{os.getpid()}"
    assert beacon_folder.launch_folder(None).name == f"goodput-{os.getuid()}-local-{os.getpid()}"
    folder = beacon_folder.attempt_folder(launch, 3)
    assert folder == launch / "attempt-3"
    for path in (launch, folder):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert beacon_folder.attempt_folder(launch, 3) == folder  # a private folder of ours: reused


@pytest.mark.parametrize("kind", ["symlink", "open"])
def test_a_planted_or_open_folder_is_refused(tmp_path, kind):
    launch = tmp_path / "launch"
    if kind == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        launch.symlink_to(tmp_path / "elsewhere")
    else:
        launch.mkdir(mode=0o755)
        launch.chmod(0o755)
    with pytest.raises(GoodputError, match="is not a private folder of this user"):
        beacon_folder.attempt_folder(launch, 1)


def test_only_what_goodput_wrote_is_deleted(tmp_path):
    launch = beacon_folder.launch_folder(None, base=tmp_path)
    folder = beacon_folder.attempt_folder(launch, 1)
    # A real rank that died without closing its beacon leaves both of its files.
    code = (
        "import os, sys; from goodput.beacon import open_beacon; "
        "from goodput.ranks import BEACON_DIR_VAR; "
        "open_beacon({BEACON_DIR_VAR: sys.argv[1]}, rank=0, world_size=1, local_rank=0, "
        "host='h'); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True, timeout=60)
    assert beacon.beacon_path(folder, 0).exists() and beacon.stack_path(folder, 0).exists()
    (folder / ".rank-00001.beacon.tmp-77").write_bytes(beacon.MAGIC + b"\0" * 8)  # half-made
    (folder / "rank-00002.stack").write_bytes(b"not goodput's\n")
    target = tmp_path / "precious"
    target.write_bytes(beacon.STACK_HEADER)
    (folder / "rank-00003.stack").symlink_to(target)
    left = beacon_folder.remove_folder(launch)
    assert sorted(left) == ["rank-00002.stack", "rank-00003.stack"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(left) and target.exists()
    (folder / "rank-00002.stack").unlink()
    (folder / "rank-00003.stack").unlink()
    assert beacon_folder.remove_folder(launch) == [] and not launch.exists()


# --- the command that reaches each host ---------------------------------------------------------


def _plan(env, hostfile=None, profile="generic"):
    return plan_launch(read_placement(env, hostfile), load_profile(profile), run_dir=Path("/r"))


def test_slurm_forensics_overlap_the_hung_step_without_the_profiles_extras():
    plan = _plan({"SLURM_JOB_ID": "812", "SLURM_JOB_NODELIST": "nid[001-002]"}, None, "perlmutter")
    spec = build_host_command(plan, ("nid002",), ARGV, {"A": "1"}, overlap=True)
    assert spec.argv == [
        "srun",
        "--overlap",
        "--nodes",
        "1",
        "--ntasks",
        "1",
        "--nodelist",
        "nid002",
        "--mem",
        "256M",
        *ARGV,
    ]
    assert spec.env["A"] == "1" and spec.env["GOODPUT_PROBE_HOST"] == "nid002"
    probe = build_host_command(plan, ("nid002",), plan.profile.health_command(), {})
    assert probe.argv[:7] == ["srun", "--nodes", "1", "--ntasks", "1", "--nodelist", "nid002"]
    assert "--gpus-per-node=4" in probe.argv and probe.label == "nid002"


@pytest.mark.parametrize(
    ("profile", "head"),
    [
        ("generic", ["mpiexec", "-n", "1", "-hosts", "n2", "-genv", "GOODPUT_PROBE_HOST", "n2"]),
        ("aurora", ["mpiexec", "--np", "1", "--hosts", "n2", "--env", "GOODPUT_PROBE_HOST=n2"]),
    ],
)
def test_pbs_forensics_run_through_mpiexec_on_one_host(profile, head):
    plan = _plan({"PBS_JOBID": "42.pbs"}, "n1\nn2\n", profile)
    assert build_host_command(plan, ("n2",), ARGV, {}, overlap=True).argv == [*head, *ARGV]


def test_local_forensics_run_here_and_hosts_are_checked():
    plan = _plan({})
    assert build_host_command(plan, ("localhost",), ARGV, {}).argv == ARGV
    with pytest.raises(GoodputError, match="is not a valid host name"):
        build_host_command(plan, ("-oProxyCommand=x",), ARGV, {})


# --- the site profiles' device probes -----------------------------------------------------------


def _documented_probes() -> dict[str, list[str]]:
    """docs/launch.md's table of each shipped profile's probe: | `name` | `command` |."""
    text = (REPO / "docs" / "launch.md").read_text()
    rows = re.findall(
        r"^\| `([a-z]+)` \| `(python -m goodput\.launch\.health[^`]*)` \|", text, re.M
    )
    return {name: command.split() for name, command in rows}


def test_each_shipped_profile_probes_as_the_docs_say():
    documented = _documented_probes()
    assert sorted(documented) == profile_names()
    for name in profile_names():
        argv = load_profile(name).health_command()
        assert argv[0] == sys.executable  # the launcher's own Python, not the job's PATH's
        assert ["python", *argv[1:]] == documented[name], name
    assert documented["aurora"][-2:] == ["--expect-devices", "6"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('health_vendor = "nvidia"\n', "'health_vendor' is set but has no effect"),
        ("health_expect_devices = 4\n", "'health_expect_devices' is set but has no effect"),
        ('health_device = true\nhealth_check = ["true"]\n', "'health_check' is set but has no"),
        ('health_device = true\nhealth_vendor = "via"\n', "'health_vendor' = 'via' is not"),
        ("health_device = true\nhealth_expect_devices = 0\n", "is not in \\[1, 1024\\]"),
        ('health_device = "yes"\n', "health_device"),
    ],
)
def test_a_bad_device_key_is_refused_naming_the_profile_file(tmp_path, text, message):
    path = tmp_path / "site.toml"
    path.write_text(text)
    with pytest.raises(GoodputError, match=message) as error:
        load_profile(str(path))
    assert error.value.where.startswith(str(path))


def test_a_profile_without_an_expected_count_checks_the_devices_it_finds(tmp_path):
    path = tmp_path / "site.toml"
    path.write_text("health_device = true\n")
    assert load_profile(str(path)).health_command()[1:] == [
        "-m",
        "goodput.launch.health",
        "--device",
        "--vendor",
        "auto",
    ]


# --- a real launch that hangs, twice ------------------------------------------------------------

# Between steps a rank prints every few hundredths of a second: a short watchdog finds each hang
# soon. Start-up (imports, the model) is silent for seconds on a loaded 2-core machine: a bound of
# its own until the first step line.
WATCHDOG = ["--timeout", "4", "--startup-timeout", "30"]


def _stop_rank0_of_the_second_attempt(launcher: subprocess.Popen[str], heartbeat: Path) -> int:
    """Once attempt 2's ranks run and made a step, SIGSTOP its rank 0; its pid."""
    first: set[int] = set()
    deadline = time.monotonic() + 120
    while launcher.poll() is None and time.monotonic() < deadline:
        pids = launched_rank_pids(launcher.pid)
        if not first:
            first = set(pids.values())
        elif pids and not set(pids.values()) & first and 0 in pids:
            seen = Path(f"/proc/{pids[0]}").stat().st_mtime
            try:
                stepped = json.loads(heartbeat.read_text())["time"] > seen
            except (OSError, ValueError, KeyError):
                stepped = False
            if stepped:
                os.kill(pids[0], signal.SIGSTOP)
                return pids[0]
        time.sleep(0.05)
    raise AssertionError("attempt 2 never ran a step")


def test_a_stalled_rank_and_a_stopped_rank_are_named_in_every_attempt(tmp_path):
    config = tiny_run_config(tmp_path)
    config = replace(config, train=replace(config.train, steps=40))
    (tmp_path / "run.toml").write_text(to_toml(config))
    plan = {
        "fired_dir": str(tmp_path / "fired"),
        "faults": [{"id": 0, "kind": "stall", "step": 3, "rank": 1, "where": "data"}],
    }
    (tmp_path / "faults.json").write_text(json.dumps(plan))
    launch_dir = tmp_path / "launch"
    argv = [sys.executable, "-m", "goodput", "launch", "--nproc", "2", *WATCHDOG]
    argv += ["--grace", "1", "--retries", "1", "--backoff", "0.1", "--run-dir", str(launch_dir)]
    argv += ["--", sys.executable, "-m", "goodput", "train", "run.toml"]
    env = outside_any_job(GOODPUT_FAULTS=str(tmp_path / "faults.json"))
    launcher = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stopped = _stop_rank0_of_the_second_attempt(launcher, launch_dir / rundir.HEARTBEAT)
        _, err = launcher.communicate(timeout=120)
    except AssertionError:
        launcher.kill()
        raise AssertionError(launcher.communicate()[1]) from None
    finally:
        launcher.kill()
    assert launcher.returncode == 124, err
    first, second = read_attempts(launch_dir / rundir.ATTEMPTS)
    assert first.class_ == second.class_ == "hang"
    stall = first.evidence[0]
    assert (stall.source, stall.host, stall.rank, stall.step) == ("hang-suspect", "localhost", 1, 3)
    assert re.fullmatch(
        r"hang suspect: rank 1 on localhost \(pid \d+\) not in a collective at step 3, phase "
        r"data, while 1 rank\(s\) wait in [a-z_.]+; stack: faults\.py:\d+ stall <- .*",
        stall.said,
    ), stall.said
    stop = second.evidence[0]
    assert (stop.source, stop.host, stop.rank) == ("hang-suspect", "localhost", 0)
    assert stop.said.startswith(
        f"hang suspect: rank 0 on localhost (pid {stopped}) stopped (SIGSTOP)"
    )
    assert f"launch:   localhost: {stall.said} [hang-suspect]" in err  # the attempt line
    assert "launch: forensics: 2 beacon(s) read on 1 host(s) in " in err
    # The launch's beacon folders went with it.
    root = beacon_folder.launch_folder(None).parent
    assert not (root / f"goodput-{os.getuid()}-local-{launcher.pid}").exists()


def test_a_reused_attempt_folder_starts_without_stale_beacons(tmp_path):
    launch = beacon_folder.launch_folder(None, base=tmp_path)
    folder = beacon_folder.attempt_folder(launch, 1)
    beacon.stack_path(folder, 0).write_bytes(beacon.STACK_HEADER)
    (folder / "kept.txt").write_text("not goodput's")
    assert beacon_folder.attempt_folder(launch, 1) == folder
    assert [p.name for p in folder.iterdir()] == ["kept.txt"]


def test_a_host_command_that_hangs_floods_or_fails_gives_no_answer(tmp_path):
    def answer(code: str, timeout_s: float = 5.0) -> bytes | None:
        """What forensics takes of a host's answer: a whole output of a command that exited 0."""
        argv = [sys.executable, "-c", code]
        said = run_bounded(argv, dict(os.environ), timeout_s, forensics.MAX_REPORT_BYTES)
        return said.output if said.code == 0 and not said.cut else None

    assert answer("print('{}')") == b"{}\n"
    assert answer("import sys; print('{}'); sys.exit(1)") is None
    assert answer("import sys; sys.stdout.write('x' * (1 << 20))") is None
    marker = tmp_path / "grandchild"
    started = time.monotonic()
    hung = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.5); "
        f'open({str(marker)!r}, "w")\']); time.sleep(60)'
    )
    assert answer(hung, timeout_s=0.3) is None
    assert time.monotonic() - started < 3
    time.sleep(0.5)
    assert not marker.exists()  # its whole group went with it


def _silent_attempt(hook, capsys, pid_file: Path) -> tuple[AttemptResult, str]:
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    silent = ProcessSpec([sys.executable, "-c", code], dict(os.environ), "r")
    result = run_attempt(
        [silent],
        idle_timeout_s=0.3,
        grace_s=0.5,
        out=io.BytesIO(),
        on_idle_timeout=hook,
        on_idle_timeout_bound_s=1.0,
    )
    return result, capsys.readouterr().err


def test_the_idle_hook_runs_before_the_stop_and_fills_the_suspects(capsys, tmp_path):
    states = []

    def hook(notice):
        pid = int((tmp_path / "pid").read_text())
        states.append(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
        notice("launch: forensics: looked")
        return (Evidence("localhost", "hang suspect: rank 0", "hang-suspect", 0, 1),)

    result, err = _silent_attempt(hook, capsys, tmp_path / "pid")
    assert result.timed_out and result.exit_code == 124
    assert states == ["S"]  # the rank still ran, asleep: not stopped yet
    assert [s.rank for s in result.suspects] == [0]
    assert err.index("no output for 0.3 s") < err.index("launch: forensics: looked")


@pytest.mark.parametrize(
    ("behaviour", "said"),
    [("hang", "forensics gave no answer within 1 s"), ("raise", "forensics failed: OSError")],
)
def test_a_hook_that_hangs_or_fails_still_lets_the_ranks_stop(capsys, tmp_path, behaviour, said):
    def hook(notice):
        if behaviour == "raise":
            raise OSError("broken")
        time.sleep(30)

    started = time.monotonic()
    result, err = _silent_attempt(hook, capsys, tmp_path / "pid")
    assert result.suspects == () and result.exit_code == 124 and said in err
    assert time.monotonic() - started < 5
