"""``goodput launch --auto-retry``: classification, spare swaps, health probes and stop rules.

The end-to-end tests run the real CLI under an emulated PBS job: ``PBS_NODEFILE`` names hosts
n1..n4 and the machine profile gives MPICH's real ``mpiexec`` its ``-launcher fork``, so Hydra
runs every "host" on this machine while it still assigns ranks to hosts, writes our host files
and reports a dead rank's host by name. One machine cannot have a bad node, so a host is "bad"
because the test lists it in a file that the ranks and the health probe (a small script standing
in for a site's node check) read; everything else — processes that really die by SIGKILL, go
silent, never print a step — is real.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from goodput import cli
from goodput.errors import GoodputError
from goodput.launch.attempt import AttemptResult
from goodput.launch.env import read_placement
from goodput.launch.failover import (
    BAD_NODE_PATTERNS,
    PEER_PATTERNS,
    EvidenceScanner,
    Heartbeat,
    Pool,
    Progress,
    classify,
    finished,
    probe_hosts,
    progress,
    read_heartbeat,
)
from goodput.launch.history import Evidence, read_attempts
from goodput.launch.launchers import ProfileConfig, load_profile, plan_launch
from goodput.launch.retry import Policy, run_attempts
from goodput.launch.run import MAX_STEPLESS_ATTEMPTS
from goodput.testing.jobs import outside_any_job

HOSTS = ["n1", "n2", "n3", "n4"]

# A rank: its host is line rank of the launcher's host file (ppn 1). On a host listed in
# bad-hosts, or on the TARGET host, it does what BEHAVIOUR says; elsewhere it trains for 3
# steps, or blocks as a peer in a collective would once the bad rank stops answering.
WORKER = """
import os, pathlib, signal, sys, time
from goodput.ranks import launch_hosts
state = pathlib.Path(os.environ["TEST_STATE"])
rank = int(os.environ["PMI_RANK"])
hosts = launch_hosts(os.environ)
host = hosts[rank]
bad = (state / "bad-hosts").read_text().split()
behaviour = os.environ["BEHAVIOUR"]
with open(state / "runs", "a") as runs:
    runs.write(f"{host}\\n")
if behaviour == "config-bug":
    print("Traceback: KeyError: 'model.dim'", flush=True)
    sys.exit(1)
crashed = state / "crashed"
if host == os.environ["TARGET"] and behaviour == "device-error":
    print("step=1", flush=True)
    print(f"goodput: error: rank {rank} on {host}: CUDA error: device lost", flush=True)
    sys.exit(1)
if host == os.environ["TARGET"] and behaviour == "crash-once" and not crashed.exists():
    crashed.write_text("")
    print("step=1", flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)  # Hydra reports "RUNNING AT host", "EXIT CODE: 11"
if behaviour == "transient-hang" and not (state / "hung-once").exists():
    if rank == 0:
        (state / "hung-once").write_text("")
    print("step=1", flush=True)
    time.sleep(60)  # every rank goes quiet: a collective that never completes
for step in range(1, 4):
    if host in bad and step == 2:
        if behaviour == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # "hang": silent, alive by kill -0
    if host not in bad and any(h in bad for h in hosts):
        if step == 2 and behaviour == "hang":
            time.sleep(60)  # waits on the hung peer
    if rank == 0:
        print(f"step={step}", flush=True)
    time.sleep(0.2)
"""

# The site's node check, standing in for e.g. `nvidia-smi -q`: fails on a listed host.
PROBE = """
import os, pathlib, sys
state = pathlib.Path(os.environ["TEST_STATE"])
host = os.environ["GOODPUT_PROBE_HOST"]
with open(state / "probed", "a") as probed:
    probed.write(host + "\\n")
sick = host in (state / "bad-hosts").read_text().split()
print(f"probe {host}: {'GPU 3 missing' if sick else 'ok'}")
sys.exit(1 if sick else 0)
"""

needs_mpiexec = pytest.mark.skipif(
    shutil.which("mpiexec") is None, reason="needs MPICH's mpiexec (apt: mpich)"
)


def _emulated_pbs(
    tmp_path: Path, bad: list[str], behaviour: str, target: str = ""
) -> tuple[dict[str, str], Path]:
    state = tmp_path / "state"
    state.mkdir()
    (state / "bad-hosts").write_text("\n".join(bad) + "\n")
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "probe.py").write_text(PROBE)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("\n".join(HOSTS) + "\n")
    profile = tmp_path / "emulated.toml"
    profile.write_text(
        textwrap.dedent(f"""\
            ppn = 1
            mpiexec = "hydra"
            mpiexec_args = ["-launcher", "fork"]
            health_check = ["{sys.executable}", "{tmp_path / "probe.py"}"]
            health_timeout_s = 20
        """)
    )
    env = outside_any_job(
        PBS_JOBID="4242.emulated",
        PBS_NODEFILE=str(nodefile),
        GOODPUT_PROFILE=str(profile),
        TEST_STATE=str(state),
        BEHAVIOUR=behaviour,
        TARGET=target,
    )
    return env, state


def _auto_retry(
    tmp_path: Path, env: dict[str, str], *flags: str
) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "goodput", "launch", "--auto-retry", "--nhosts", "2"]
    argv += ["--run-dir", str(run_dir), "--grace", "1", "--backoff", "0.1", *flags]
    argv += ["--", sys.executable, str(tmp_path / "worker.py")]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    return result, read_log(run_dir / "attempts.jsonl")


def read_log(path: Path) -> list[dict]:
    return [record.to_json() for record in read_attempts(path)]  # strictly, as a report reads


def auto_retry(attempt, log: Path, pool: Pool, sleep, backoff_s: float = 5.0) -> int:
    """``--auto-retry``'s policy around ``attempt``, with a probe that finds every host healthy."""
    policy = Policy(
        max_attempts=None,
        backoff_s=backoff_s,
        patterns=BAD_NODE_PATTERNS,
        peer_patterns=PEER_PATTERNS,
        probe=lambda hosts: {},
        max_stepless=MAX_STEPLESS_ATTEMPTS,
    )
    return run_attempts(attempt, policy, pool, attempts_log=log, sleep=sleep)


@needs_mpiexec
def test_a_rank_killed_on_a_sick_host_is_probed_and_a_spare_takes_its_place(tmp_path):
    env, state = _emulated_pbs(tmp_path, bad=["n2"], behaviour="die")
    result, attempts = _auto_retry(tmp_path, env, "--timeout", "30")
    assert result.returncode == 0, result.stderr
    first, second = attempts
    assert first["class"] == "bad-node" and first["hosts"] == ["n1", "n2"]
    (evidence,) = first["evidence"]
    # Hydra's report of the SIGKILLed rank made n2 a suspect; its failed probe evicted it.
    assert evidence["host"] == "n2" and evidence["source"] == "probe"
    assert "RUNNING AT n2" in evidence["said"] and "GPU 3 missing" in evidence["said"]
    assert first["replaced"] == {"n2": "n3"} and first["decision"] == "retry"
    assert second["class"] == "success" and second["hosts"] == ["n1", "n3"]
    assert second["steps_gained"] == 3 and second["spares_left"] == ["n4"]
    assert state.joinpath("probed").read_text().split() == ["n2"]  # the suspect alone
    assert "replaced n2 -> n3" in result.stderr


@needs_mpiexec
def test_a_device_error_line_is_host_evidence_a_spare_replaces_its_host(tmp_path):
    env, state = _emulated_pbs(tmp_path, bad=[], behaviour="device-error", target="n2")
    result, attempts = _auto_retry(tmp_path, env, "--timeout", "30")
    assert result.returncode == 0, result.stderr
    first, second = attempts
    assert first["class"] == "bad-node" and first["hosts"] == ["n1", "n2"]
    assert first["evidence"] == [
        {
            "host": "n2",
            "said": "goodput: error: rank 1 on n2: CUDA error: device lost",
            "source": "log",
            "rank": None,
            "step": None,
        }
    ]
    assert first["replaced"] == {"n2": "n3"} and first["spares_left"] == ["n4"]
    assert second["class"] == "success" and second["hosts"] == ["n1", "n3"]
    assert not (state / "probed").exists()  # the host's own failure needs no probe
    assert "replaced n2 -> n3" in result.stderr


@needs_mpiexec
def test_a_crashed_rank_is_peer_evidence_its_host_stays_when_its_probe_passes(tmp_path):
    env, state = _emulated_pbs(tmp_path, bad=[], behaviour="crash-once", target="n2")
    result, attempts = _auto_retry(tmp_path, env, "--timeout", "30")
    assert result.returncode == 0, result.stderr
    first, second = attempts
    assert first["class"] == "error" and first["exit_code"] != 0
    assert first["evidence"] == [] and first["replaced"] == {}
    assert state.joinpath("probed").read_text().split() == ["n2"]  # the suspect alone
    assert second["class"] == "success" and second["hosts"] == ["n1", "n2"]
    assert second["spares_left"] == ["n3", "n4"]
    told = [line for line in result.stderr.splitlines() if "health probe passed" in line]
    assert told == ["launch:   n2: =   EXIT CODE: 11 [peer; health probe passed: kept]"]
    assert "same hosts" in result.stderr


@needs_mpiexec
def test_a_crashed_rank_on_a_host_that_fails_its_probe_evicts_it_on_the_probe(tmp_path):
    env, state = _emulated_pbs(tmp_path, bad=["n2"], behaviour="crash-once", target="n2")
    result, attempts = _auto_retry(tmp_path, env, "--timeout", "30")
    assert result.returncode == 0, result.stderr
    first, second = attempts
    assert first["class"] == "bad-node"  # confirmed by the failed probe
    (evidence,) = first["evidence"]
    assert evidence["host"] == "n2" and evidence["source"] == "probe"
    assert "RUNNING AT n2" in evidence["said"]  # the peer evidence that made it a suspect
    assert evidence["said"].endswith("health probe exit 1: probe n2: GPU 3 missing")
    assert state.joinpath("probed").read_text().split() == ["n2"]
    assert first["replaced"] == {"n2": "n3"}
    assert second["class"] == "success" and second["hosts"] == ["n1", "n3"]


@needs_mpiexec
def test_a_silent_hang_probes_every_host_and_evicts_only_the_sick_one(tmp_path):
    env, state = _emulated_pbs(tmp_path, bad=["n2"], behaviour="hang")
    result, attempts = _auto_retry(tmp_path, env, "--timeout", "2")
    assert result.returncode == 0, result.stderr
    first, second = attempts
    assert first["class"] == "hang" and first["exit_code"] == 124
    (evidence,) = first["evidence"]
    assert evidence == {
        "host": "n2",
        "said": "health probe exit 1: probe n2: GPU 3 missing",
        "source": "probe",
        "rank": None,
        "step": None,
    }
    assert sorted(state.joinpath("probed").read_text().split()) == ["n1", "n2"]
    assert first["replaced"] == {"n2": "n3"}
    assert second["class"] == "success" and second["hosts"] == ["n1", "n3"]


@needs_mpiexec
def test_a_hang_on_healthy_hosts_retries_on_the_same_hosts(tmp_path):
    env, _ = _emulated_pbs(tmp_path, bad=[], behaviour="transient-hang")
    result, attempts = _auto_retry(tmp_path, env, "--timeout", "2")
    assert result.returncode == 0, result.stderr
    first, second = attempts
    assert first["class"] == "hang" and first["evidence"] == [] and first["replaced"] == {}
    assert second["class"] == "success" and second["hosts"] == first["hosts"] == ["n1", "n2"]
    assert "same hosts" in result.stderr


@needs_mpiexec
def test_two_attempts_without_a_step_stop_before_the_spares_burn(tmp_path):
    env, state = _emulated_pbs(tmp_path, bad=[], behaviour="config-bug")
    result, attempts = _auto_retry(tmp_path, env, "--timeout", "30")
    assert result.returncode == 1
    assert [a["class"] for a in attempts] == ["stuck-pre-training"] * 2
    assert [a["decision"] for a in attempts] == ["retry", "stop"]
    assert all(a["hosts"] == ["n1", "n2"] and a["replaced"] == {} for a in attempts)
    assert attempts[-1]["spares_left"] == ["n3", "n4"]
    assert "2 attempts in a row made no step" in result.stderr
    assert len(state.joinpath("runs").read_text().split()) == 4  # 2 attempts x 2 ranks


@needs_mpiexec
def test_it_stops_when_no_spare_is_left(tmp_path):
    env, _ = _emulated_pbs(tmp_path, bad=["n2", "n3", "n4"], behaviour="die")
    result, attempts = _auto_retry(tmp_path, env, "--timeout", "30")
    assert result.returncode != 0
    assert [a["hosts"] for a in attempts] == [["n1", "n2"], ["n1", "n3"], ["n1", "n4"]]
    assert [a["class"] for a in attempts] == ["bad-node"] * 3
    assert attempts[-1]["decision"] == "stop" and attempts[-1]["spares_left"] == []
    assert "no spare left for n4" in result.stderr


@needs_mpiexec
def test_walltime_stops_at_once(tmp_path):
    env, _ = _emulated_pbs(tmp_path, bad=["n2"], behaviour="hang")
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "goodput", "launch", "--auto-retry", "--nhosts", "2"]
    argv += ["--run-dir", str(run_dir), "--grace", "1", "--"]
    argv += [sys.executable, str(tmp_path / "worker.py")]
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert launcher.stdout is not None
    assert launcher.stdout.readline().strip().endswith(b"step=1")
    launcher.send_signal(signal.SIGTERM)  # what the scheduler does at walltime
    assert launcher.wait(30) == 143
    (record,) = read_log(run_dir / "attempts.jsonl")
    assert record["class"] == "walltime" and record["decision"] == "stop"


def test_host_evidence_names_hosts_as_launchers_print_it():
    pool = ["nid001", "nid002", "x4102c0s1b0n0", "localhost"]
    scanner = EvidenceScanner(BAD_NODE_PATTERNS, pool, peer_patterns=PEER_PATTERNS)
    lines = [
        "srun: error: nid002: task 7: Terminated",  # the innocent cascade names no one
        "[rank3]: RuntimeError: boom",
        "srun: error: nid001: task 3: Bus error",
        "===================================================================================",
        "=   PID 20611 RUNNING AT x4102c0s1b0n0.hostmgmt2000.cm",
        "=   EXIT CODE: 7",
        "srun: error: nid999: task 0: Bus error",  # not in the pool: not ours to evict
    ]
    for line in lines:
        scanner(line.encode())
    assert sorted(scanner.found) == ["nid001", "x4102c0s1b0n0"]
    assert scanner.found["x4102c0s1b0n0"].said.endswith("EXIT CODE: 7")
    assert scanner.suspected == {}  # a memory fault (SIGBUS) is the host's, not a peer's


def test_a_rank_killed_by_sigkill_makes_its_host_a_suspect():
    # The OOM killer and a user's kill -9 look the same as a dying node's: probe before blaming.
    scanner = EvidenceScanner(BAD_NODE_PATTERNS, ["nid001", "n2"], peer_patterns=PEER_PATTERNS)
    for line in [
        "srun: error: nid001: task 3: Killed",
        "=   PID 1 RUNNING AT n2",
        "=   EXIT CODE: 9",
    ]:
        scanner(line.encode())
    assert scanner.found == {}
    assert sorted(scanner.suspected) == ["n2", "nid001"]


def test_a_peer_that_went_away_makes_its_host_a_suspect_not_a_bad_node():
    pool = ["localhost", "n1", "nid002", "nid003"]
    scanner = EvidenceScanner(BAD_NODE_PATTERNS, pool, peer_patterns=PEER_PATTERNS)
    # gloo names the peer by address: the real resolver turns 127.0.0.1 into localhost.
    gloo = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    scanner(f"{gloo} [127.0.0.1]:29500".encode())
    for line in [
        "=   PID 1 RUNNING AT n1",
        "=   EXIT CODE: 11",
        "NCCL WARN socketProgress: Connection closed by remote peer nid002.hsn<46353>",
        "srun: error: nid003: task 5: Exited with exit code 1",
    ]:
        scanner(line.encode())
    assert scanner.found == {}
    assert sorted(scanner.suspected) == ["localhost", "n1", "nid002", "nid003"]
    assert scanner.suspected["n1"].said.endswith("EXIT CODE: 11")
    read_error = "Read error [127.0.0.1]:6021: Connection reset by peer. This is typically ..."
    reset = EvidenceScanner([], ["localhost"], peer_patterns=PEER_PATTERNS)
    reset(read_error.encode())
    assert list(reset.suspected) == ["localhost"]


def test_the_launchers_teardown_names_no_one():
    scanner = EvidenceScanner(BAD_NODE_PATTERNS, ["n1", "n2"], peer_patterns=PEER_PATTERNS)
    for line in [
        "=   PID 1 RUNNING AT n1",
        "=   EXIT CODE: 15",
        "srun: error: n2: task 0: Terminated",
    ]:
        scanner(line.encode())
    assert scanner.found == {} and scanner.suspected == {}


def test_goodput_train_names_its_host_on_a_device_error(capsys, monkeypatch, tmp_path):
    def device_error(cfg):
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered\nmore")

    monkeypatch.setattr("goodput.train.loop.train", device_error)
    config = Path(__file__).parents[3] / "configs" / "tiny-cpu.toml"
    assert cli.main(["train", str(config), f"train.run_dir={str(tmp_path / 'run')!r}"]) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith("goodput: error: rank ") and "CUDA error" in line
    assert "\n" not in line
    scanner = EvidenceScanner(BAD_NODE_PATTERNS, [socket.gethostname()])
    scanner(line.encode())
    assert list(scanner.found) == [socket.gethostname()]


def _result(code: int, *, timed_out: bool = False, signal_: int | None = None) -> AttemptResult:
    return AttemptResult(code, 1.0, timed_out, "0", 0, None, None, [], signal_)


def test_classes():
    named = [Evidence("n1", "srun: error: n1: task 0: Bus error", "log")]
    assert classify(_result(0), 0, []) == "success"
    assert classify(_result(143), 5, []) == "walltime"
    assert classify(_result(143), 5, named) == "bad-node"  # a real fault raced the walltime
    assert classify(_result(143, signal_=signal.SIGTERM), 5, named) == "walltime"
    assert classify(_result(130, signal_=signal.SIGINT), 5, []) == "interrupted"
    assert classify(_result(124, timed_out=True), 5, []) == "hang"
    assert classify(_result(1), 0, []) == "stuck-pre-training"
    assert classify(_result(1), 3, []) == "error"


def test_the_heartbeat_counts_steps_that_printed_nothing(tmp_path):
    heartbeat = tmp_path / "heartbeat"
    heartbeat.write_text(json.dumps({"step": 42, "time": 1700000000.5}))
    after = read_heartbeat(heartbeat)
    assert after == Heartbeat(42, 1700000000.5)
    assert progress(_result(1), Heartbeat(40, 1.0), after) == Progress(2, 42)
    # A resumed attempt that died before the step the last one reached still stepped.
    assert progress(_result(1), Heartbeat(50, 1.0), after) == Progress(1, 42)
    assert progress(_result(1), after, after) == Progress(0, None)  # not rewritten: no step
    assert read_heartbeat(tmp_path / "absent") is None
    for text in ["{half", '{"step": 3}', '{"step": -1, "time": 0}', '{"step": 3, "time": "x"}']:
        heartbeat.write_text(text)  # replaced mid-read, or not a heartbeat
        assert read_heartbeat(heartbeat) is None


def test_the_last_beat_says_done_counts_only_its_steps_and_makes_the_attempt_a_success(tmp_path):
    heartbeat = tmp_path / "heartbeat"
    heartbeat.write_text(json.dumps({"step": 50, "time": 9.5, "done": True}))
    done = read_heartbeat(heartbeat)
    assert done == Heartbeat(50, 9.5, done=True)
    # Written at the run's end, not at a step: a resumed attempt that only finished made none.
    assert progress(_result(124, timed_out=True), Heartbeat(50, 1.0), done) == Progress(0, None)
    assert progress(_result(124, timed_out=True), Heartbeat(45, 1.0), done) == Progress(5, 50)
    assert finished(Heartbeat(50, 1.0), done) and finished(None, done)
    assert not finished(done, done)  # said by an earlier attempt, not this one
    assert not finished(Heartbeat(40, 1.0), Heartbeat(50, 2.0))
    assert classify(_result(124, timed_out=True), 0, [], finished=True) == "success"
    assert classify(_result(137), 3, [], finished=True) == "success"
    for text in ['{"step": 3, "time": 1, "done": 1}', '{"step": 3, "time": 1, "done": "yes"}',
                 '{"step": 3, "time": 1, "done": true, "x": 0}']:  # fmt: skip
        heartbeat.write_text(text)  # not a heartbeat of goodput's
        assert read_heartbeat(heartbeat) is None


def test_probes_run_at_once_and_a_silent_one_times_out(tmp_path):
    # The default probe on "good"; on "quiet" it never answers.
    code = (
        "import os, runpy, time\n"
        "if os.environ['GOODPUT_PROBE_HOST'] == 'quiet':\n    time.sleep(30)\n"
        "runpy.run_module('goodput.launch.health', run_name='__main__')"
    )
    profile = ProfileConfig(name="t", health_check=(sys.executable, "-c", code), health_timeout_s=3)
    plan = plan_launch(read_placement({}), profile, run_dir=tmp_path)
    plan = replace(plan, hosts=("good", "quiet"))
    started = time.monotonic()
    failed = probe_hosts(plan, plan.hosts, os.environ)
    assert time.monotonic() - started < 15
    assert list(failed) == ["quiet"] and "no answer within 3 s" in failed["quiet"].said


def test_a_usage_error_is_not_retried(tmp_path):
    calls = []

    def attempt(hosts, on_line):
        calls.append(hosts)
        return _result(2)

    code = auto_retry(attempt, tmp_path / "attempts.jsonl", Pool(["a"], ["b"]), lambda s: None)
    assert code == 2 and len(calls) == 1


def test_bad_patterns_in_a_profile_are_refused(tmp_path):
    path = tmp_path / "site.toml"
    path.write_text("bad_node_patterns = ['node (\\\\S+) died']\n")
    with pytest.raises(Exception, match="names no host"):
        load_profile(str(path))
    path.write_text("bad_node_patterns = ['(?P<host>']\n")
    with pytest.raises(Exception, match="not a regular expression"):
        load_profile(str(path))


def test_a_probe_that_cannot_start_is_a_clear_error(tmp_path):
    profile = ProfileConfig(name="t", health_check=("/nonexistent/node-check",), health_timeout_s=1)
    plan = plan_launch(read_placement({}), profile, run_dir=tmp_path)
    with pytest.raises(GoodputError, match="fix health_check in the machine profile"):
        probe_hosts(plan, plan.hosts, os.environ)


def test_the_backoff_doubles_without_progress_and_is_short_after_it(tmp_path):
    # (exit code, steps printed) per attempt; every failure is an "error" on healthy hosts.
    # Attempts 2 and 3 reach no step past 5 (none, then the same crash at step 5 again).
    script = iter([(1, (1, 5)), (1, None), (1, (3, 5)), (1, (3, 9)), (0, (10, 12))])
    delays = []

    def attempt(hosts, on_line):
        code, steps = next(script)
        first, last = steps if steps else (None, None)
        seen = last - first + 1 if steps else 0
        return AttemptResult(code, 1.0, False, None, seen, last, first, [])

    code = auto_retry(
        attempt, tmp_path / "attempts.jsonl", Pool(["a"], []), delays.append, backoff_s=4.0
    )
    assert code == 0
    quick, low, doubled, quick_again = delays
    assert 0.5 <= quick <= 1.0 and 0.5 <= quick_again <= 1.0  # after progress
    assert 2.0 <= low <= 4.0 and 4.0 <= doubled <= 8.0  # 1, then 2 attempts without it
    records = read_log(tmp_path / "attempts.jsonl")
    assert [r["class"] for r in records] == [
        "error", "stuck-pre-training", "error", "error", "success"
    ]  # fmt: skip
    assert [r["steps_gained"] for r in records] == [5, 0, 3, 7, 3]


@pytest.mark.parametrize("name", ["aurora", "polaris"])
def test_pals_profiles_name_the_node_pals_lost(name):
    profile = load_profile(name)
    pool = ["x4102c5s2b0n0", "x4102c5s3b0n0", "x4102c5s4b0n0"]
    scanner = EvidenceScanner([*BAD_NODE_PATTERNS, *profile.bad_node_patterns], pool)
    for line in [
        "x4102c5s2b0n0.hostmgmt2000.cm.americas.sgi.com: rank 12 died from signal 15",
        "x4102c5s3b0n0.hostmgmt2000.cm.americas.sgi.com: shepherd died from signal 9",
        "mpiexec: Couldn't forward RPC launch(1234) to child x4102c5s4b0n0.hsn.cm.aurora",
    ]:
        scanner(line.encode())
    assert sorted(scanner.found) == ["x4102c5s3b0n0", "x4102c5s4b0n0"]
