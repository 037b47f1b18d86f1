"""The launcher's fan-out (``launch.fanout``) at the scale of a machine, under a stand-in
scheduler: ``srun`` and ``mpiexec`` scripts first on PATH (``goodput.testing.jobs``) that answer
for every host they are given, at once, as the real ones running goodput's task do, and log
when each of them runs. A health probe and a hang-forensics collection of 2,048 hosts each
finish through one step, give every host the answer a step of its own gives it, and never have
more than ``MAX_CHILDREN`` children at once; hostile answers (huge, not UTF-8, tagged as another
host, missing, garbage lines, a step that never ends) are bounded and attributed to their own
host only. The real Slurm and MPICH runs are in test_slurm, test_forensics_slurm and
test_failover."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from goodput.errors import GoodputError
from goodput.launch import fanout, forensics, suspects
from goodput.launch.env import read_placement
from goodput.launch.failover import PROBE_ANSWER_BYTES, probe_hosts
from goodput.launch.fanout import Answer, Frames, frame_lines, run_bounded
from goodput.launch.forensics import HostReport, RankReport
from goodput.launch.history import Evidence
from goodput.launch.launchers import LaunchPlan, ProfileConfig, load_profile, plan_launch
from goodput.testing.jobs import STAND_IN_REFUSALS, peak_children, stand_in_scheduler

NUM_HOSTS = 2048
HOSTS = tuple(f"n{index:04d}" for index in range(1, NUM_HOSTS + 1))
HEALTHY = {"output": "health: {host}: healthy\n"}
DOWN = "srun: error: Unable to create step for job 1: Requested node configuration is not available"


def _plan(
    tmp_path: Path, scheduler: str = "slurm", hosts: int = NUM_HOSTS, **profile: Any
) -> LaunchPlan:
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": f"n[0001-{hosts:04d}]"}
    hostfile = None
    if scheduler == "pbs":
        env, hostfile = {"PBS_JOBID": "1.pbs"}, "".join(f"{host}\n" for host in HOSTS[:hosts])
    base = load_profile(profile.pop("profile", "generic"))
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return plan_launch(read_placement(env, hostfile), replace(base, **profile), run_dir=run_dir)


@pytest.fixture
def scheduler(tmp_path, monkeypatch):
    """``install(answers)``: the stand-ins first on PATH, answering ``answers``; the
    environment and the log of their runs."""

    def install(answers: dict[str, Any]) -> tuple[dict[str, str], Path]:
        log = tmp_path / "stand-ins.log"
        log.unlink(missing_ok=True)
        env = stand_in_scheduler(tmp_path / "bin", answers, log)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return dict(os.environ), log

    return install


def _per_host(plan: LaunchPlan, hosts: tuple[str, ...], env: dict[str, str]) -> dict[str, Evidence]:
    """Each host probed by a step of its own, as the launcher once did."""
    found = {}
    for host in hosts:
        found.update(probe_hosts(plan, (host,), env))
    return found


# --- 2,048 hosts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["slurm", "pbs"])
def test_a_probe_of_2048_hosts_is_one_step_and_a_down_host_is_found_by_halves(
    tmp_path, scheduler, kind
):
    flood = "noise " * 40_000 + "\nhealth: n0100: unhealthy: /dev/shm: read back differs\n"
    answers = {
        "default": HEALTHY,
        "hosts": {
            "n0007": {"code": 1, "output": "health: n0007: unhealthy: /tmp: 3 MiB free\n"},
            "n0100": {"code": 1, "output": flood},  # 240 kB: its last 64 KiB come back
            "n0200": {"code": 1, "output_hex": "ff fe 0a 68 65 61 6c 74 68 3a 20 bf 0a"},
        },
        "refuse": ["n1500"],  # a step naming it is refused, as Slurm refuses a down node's
    }
    env, log = scheduler(answers)
    plan = _plan(tmp_path, kind)
    started = time.monotonic()
    failed = probe_hosts(plan, plan.hosts, env)
    assert time.monotonic() - started < plan.profile.health_timeout_s
    assert sorted(failed) == ["n0007", "n0100", "n0200", "n1500"]
    assert failed["n0007"].said == "health probe exit 1: health: n0007: unhealthy: /tmp: 3 MiB free"
    assert failed["n0100"].said.endswith(
        "exit 1: health: n0100: unhealthy: /dev/shm: read back differs"
    )
    assert failed["n0200"].said == "health probe exit 1: health: \ufffd"
    down = {"slurm": f"{DOWN} (n1500 is down)", "pbs": STAND_IN_REFUSALS["mpiexec"]}[kind]
    assert failed["n1500"].said == f"health probe exit 1: {down.format(host='n1500')}"
    runs = log.read_text().count("start ")
    assert runs <= 2 * 11 + 1  # one step, then two halves a level down to the down host
    assert 1 <= peak_children(log) <= fanout.MAX_CHILDREN
    # A step per host (how the launcher probed before) says the same of each.
    sample = ("n0001", "n0007", "n0100", "n0200", "n1500", "n2048")
    assert _per_host(plan, sample, env) == {h: e for h, e in failed.items() if h in sample}


def _rank(rank: int, **changes: object) -> RankReport:
    fields: dict[str, Any] = {
        "rank": rank, "world_size": NUM_HOSTS, "pid": 1000 + rank, "schedule_id": 0, "step": 9,
        "phase": "forward", "last_site": "step.tokens", "entered": 12, "left": 11,
        "flush_site": "", "flush_entered": 0, "flush_left": 0, "torn": False,
        "state": "running", "answered": True, "stack": ("distributed_c10d.py:2501 all_reduce",),
    }  # fmt: skip
    return RankReport(**{**fields, **changes})


def test_forensics_of_2048_hosts_name_the_rank_outside_the_collective(tmp_path, scheduler):
    # Rank r runs on host r (one a host); rank 1234 left its collective; four hosts answer
    # with hostile output of each kind.
    hosts = {
        host: {"output": HostReport(ranks=(_rank(rank),)).to_json()}
        for rank, host in enumerate(HOSTS)
    }
    hosts["n1235"] = {"output": HostReport(ranks=(_rank(1234, entered=11),)).to_json()}
    hosts["n0011"] = {"output": "x", "repeat": forensics.MAX_REPORT_BYTES + 1}  # too big
    hosts["n0012"] = {"output_hex": "7b22ff7d"}  # not UTF-8, not a report
    hosts["n0013"] = {**hosts["n0013"], "claims": "n0014"}  # its task says it is another host
    hosts["n0015"] = {"silent": True}
    env, log = scheduler({"hosts": hosts})
    plan = _plan(tmp_path)
    started = time.monotonic()
    reports = suspects.collect_hosts(plan, tmp_path / "beacons", env)
    assert time.monotonic() - started < plan.profile.health_timeout_s
    assert peak_children(log) <= fanout.MAX_CHILDREN
    silent = sorted(host for host, report in reports.items() if report is None)
    # n0013's answer tagged as n0014's answers for neither: both are split off until each is
    # a step of its own, where n0014 answers as itself and n0013 not at all.
    assert silent == ["n0011", "n0012", "n0013", "n0015"]
    assert reports["n0014"] == HostReport(ranks=(_rank(13),))
    found = suspects.name_suspects(reports, list(HOSTS))
    assert [(item.host, item.rank) for item in found.suspects] == [
        ("n0011", None), ("n0012", None), ("n0013", None), ("n0015", None)
    ]  # fmt: skip
    assert found.suspects[0].said == "hang suspect: host n0011 did not answer (rank(s) 10)"
    sample = ("n0001", "n0011", "n0012", "n0013", "n0014", "n0015", "n1235")
    for host in sample:
        alone = suspects.collect_hosts(replace(plan, hosts=(host,)), tmp_path / "beacons", env)
        assert alone == {host: reports[host]}, host


def test_with_many_hosts_down_no_more_steps_run_at_once_than_the_bound(
    tmp_path, scheduler, monkeypatch
):
    # 4 of 16 hosts down: halving wants 8 steps at once at its last levels; the bound, made 3
    # here (64 would take a thousand steps to reach), holds.
    monkeypatch.setattr(fanout, "MAX_CHILDREN", 3)
    down = ["n0001", "n0006", "n0011", "n0016"]
    env, log = scheduler({"default": HEALTHY, "refuse": down})
    plan = _plan(tmp_path, hosts=16)
    failed = probe_hosts(plan, plan.hosts, env)
    assert sorted(failed) == down
    assert all(
        failed[host].said == f"health probe exit 1: {DOWN} ({host} is down)" for host in down
    )
    assert log.read_text().count("start ") > 3
    assert 1 < peak_children(log) <= 3


def test_a_failure_of_every_step_is_not_split_down_to_a_step_per_host(
    tmp_path, scheduler, monkeypatch
):
    # Every step refused (say, an option this srun does not know): halving stops at the step
    # budget, made 8 here, and every host has the failure for its answer.
    monkeypatch.setattr(fanout, "MAX_STEPS", 8)
    env, log = scheduler({"default": HEALTHY, "refuse": list(HOSTS[:64])})
    plan = _plan(tmp_path, hosts=64)
    failed = probe_hosts(plan, plan.hosts, env)
    assert sorted(failed) == list(plan.hosts)
    assert all(item.said.startswith(f"health probe exit 1: {DOWN}") for item in failed.values())
    assert log.read_text().count("start ") <= 8


def test_local_commands_run_at_most_64_at_once(tmp_path):
    log = tmp_path / "runs.log"
    script = 'echo "start $$" >>"$0"; sleep 0.05; echo "health: $GOODPUT_PROBE_HOST: healthy"'
    script += '; echo "end $$" >>"$0"; [ "$GOODPUT_PROBE_HOST" != n0300 ]'
    profile = ProfileConfig(name="t", health_check=("sh", "-c", script, str(log)))
    plan = replace(
        _plan(tmp_path, "slurm", 1), scheduler="local", hosts=HOSTS[:600], profile=profile
    )
    failed = probe_hosts(plan, plan.hosts, dict(os.environ))
    assert (
        list(failed) == ["n0300"]
        and failed["n0300"].said == "health probe exit 1: health: n0300: healthy"
    )
    assert 1 < peak_children(log) <= fanout.MAX_CHILDREN


# --- hostile answers, under both launchers -------------------------------------------------------


@pytest.mark.parametrize("kind", ["slurm", "pbs"])
def test_hostile_answers_are_bounded_and_attributed_to_their_own_host(tmp_path, scheduler, kind):
    answers = {
        "default": HEALTHY,
        "hosts": {
            "n0001": {"code": 1, "output": "y" * (10 * PROBE_ANSWER_BYTES)},  # huge, no newline
            "n0003": {"claims": "n0002", "code": 1, "output": "health: n0002: unhealthy: forged\n"},
            "n0004": {"silent": True},
            "n0005": {"raw_hex": [
                b"goodput-fanout n0006 1 0 0/1 !!!".hex(),  # bad base64, for another host
                b"goodput-fanout n0006 1 0 0/99999 aGk=".hex(),  # past the bound
                ("ab" * 4096),  # a line past LINE_BYTES
                "ff00fe",  # binary
            ]},
            "n0007": {"timeout": True},
            "n0008": {"code": 2, "output": ""},
        },
    }  # fmt: skip
    env, log = scheduler(answers)
    plan = _plan(tmp_path, kind, 8, health_timeout_s=20.0)
    failed = probe_hosts(plan, plan.hosts, env)
    # One step, then halves of the hosts it left unanswered (n0002 claimed twice, n0003 and
    # n0004 silent): [n0002], where it answers for itself, and [n0003, n0004], which ran and
    # had no answer from anyone, so is not split further.
    assert log.read_text().count("start ") == 3
    assert sorted(failed) == ["n0001", "n0003", "n0004", "n0007", "n0008"]
    assert failed["n0008"].said == "health probe exit 2: no output"
    assert failed["n0001"].said.startswith("health probe exit 1: yyyy")
    assert len(failed["n0001"].said) <= len("health probe ") + 3 * 4096  # evidence's own bound
    for host in ("n0003", "n0004", "n0007"):  # n0003 spoke only as n0002: no answer of its own
        assert failed[host].said == "health probe no answer within 20 s", host


def test_a_step_that_never_ends_is_stopped_at_the_deadline_with_the_answers_in(tmp_path, scheduler):
    env, _ = scheduler({"default": HEALTHY, "hosts": {"n0003": {"hang": True}}})
    plan = _plan(tmp_path, hosts=4, health_timeout_s=2.0)
    started = time.monotonic()
    failed = probe_hosts(plan, plan.hosts, env)
    assert time.monotonic() - started < 2.0 + 2 * fanout.AFTER_KILL_WAIT_S + 1
    assert list(failed) == ["n0003"] and failed["n0003"].said.endswith("no answer within 2 s")


def test_a_launcher_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun
    plan = _plan(tmp_path, hosts=2)
    with pytest.raises(GoodputError, match="^srun: cannot start: .*; fix health_check"):
        probe_hosts(plan, plan.hosts, dict(os.environ))


# --- the task on a node, and its tagged lines ----------------------------------------------------


def test_the_task_tags_its_answer_with_its_launchers_name_for_it(tmp_path):
    command = [sys.executable, "-m", "goodput.launch.fanout", "--timeout=20", "--bytes=64"]
    command += ["--host-var=SLURMD_NODENAME", "--stderr", "--", "sh", "-c"]
    command += ['echo "$GOODPUT_PROBE_HOST" says; echo oops >&2; exit 3']
    env = {**os.environ, "SLURMD_NODENAME": "nid0042"}
    out = subprocess.run(command, env=env, capture_output=True, timeout=60, check=True).stdout
    frames = Frames({"nid0042": "nid0042"}, 64)
    for line in out.splitlines():
        frames.feed(line)
    assert frames.answers() == {"nid0042": Answer(3, b"nid0042 says\noops\n")}


def test_lines_tagged_for_another_host_or_contradicting_answer_for_no_one():
    frames = Frames({"a": "a", "b": "b"}, 1000)
    lines = frame_lines("a", Answer(0, b"x" * 500)) + frame_lines("b", Answer(1, b"b's"))
    lines += frame_lines("c", Answer(0, b"c is no host of this step"))
    lines += frame_lines("b", Answer(0, b"b again, otherwise"))  # b's answer, twice: whose?
    for line in lines:
        frames.feed(b"0: " + line.rstrip(b"\n"))  # srun --label's prefix is passed over
    assert frames.answers() == {"a": Answer(0, b"x" * 500)}
    assert len(lines[0]) < fanout.LINE_BYTES


def test_an_answer_past_the_bound_is_cut_at_the_source_and_refused_when_read():
    said = run_bounded(
        ["sh", "-c", "yes | head -c 100000; exit 5"], dict(os.environ), 20, 1000, tail=True
    )
    assert said == Answer(5, b"y\n" * 500, cut=True)
    frames = Frames({"a": "a"}, 100)
    for line in frame_lines("a", said):
        frames.feed(line.rstrip(b"\n"))
    assert frames.answers() == {}
