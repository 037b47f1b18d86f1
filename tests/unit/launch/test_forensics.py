"""Hang forensics (``launch/forensics.py`` on a host, ``launch/suspects.py`` naming): the rules
of ``name_suspects`` one by one; the faulthandler text parsed; a host's report read back
strictly; and ``collect_host`` on real child processes that hold real beacons — one in a
collective, one stalled, one SIGSTOPped, and a forged beacon whose pid belongs to a process
that is not the rank (it must not be signalled)."""

from __future__ import annotations

import faulthandler
import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from goodput import beacon
from goodput.errors import GoodputError
from goodput.launch import forensics
from goodput.launch.forensics import HostReport, RankReport, collect_host, parse_stack, read_report
from goodput.launch.suspects import name_suspects
from goodput.testing.doc_commands import command_lines

HOSTS = ["h0", "h0", "h1", "h1"]


def rank(number: int, **changes: object) -> RankReport:
    fields: dict[str, object] = {
        "rank": number,
        "world_size": 4,
        "pid": 100 + number,
        "schedule_id": 0,
        "step": 7,
        "phase": "forward",
        "last_site": "step.tokens",
        "entered": 12,
        "left": 11,
        "flush_site": "",
        "flush_entered": 0,
        "flush_left": 0,
        "torn": False,
        "state": "running",
        "answered": True,
        "stack": ("distributed_c10d.py:2501 all_reduce",),
    }
    fields.update(changes)
    return RankReport(**fields)  # type: ignore[arg-type]


def waiting(number: int, **changes: object) -> RankReport:
    return rank(number, **changes)


def idle(number: int, **changes: object) -> RankReport:
    """Not in a collective: entered == left."""
    return rank(number, **{"entered": 11, "left": 11, **changes})


def by_host(*ranks: RankReport) -> dict[str, HostReport | None]:
    return {
        "h0": HostReport(ranks=tuple(r for r in ranks if r.rank < 2)),
        "h1": HostReport(ranks=tuple(r for r in ranks if r.rank >= 2)),
    }


# --- name_suspects: one rule at a time, in order --------------------------------------------


def test_a_rank_that_cannot_answer_is_named_before_one_outside_the_collective():
    reports = by_host(
        waiting(0),
        idle(1, phase="data"),
        waiting(2, state="stopped", answered=False, entered=9, left=8),
        waiting(3),
    )
    findings = name_suspects(reports, HOSTS)
    (suspect,) = findings.suspects
    assert (suspect.host, suspect.rank, suspect.step, suspect.source) == (
        "h1",
        2,
        7,
        "hang-suspect",
    )
    assert suspect.said == (
        "hang suspect: rank 2 on h1 (pid 102) stopped (SIGSTOP) at step 7, phase forward; "
        "entered 9 collective(s), peers up to 12; stack: distributed_c10d.py:2501 all_reduce"
    )
    assert findings.line == "hang suspect(s): rank 2 on h1"


@pytest.mark.parametrize(
    ("state", "cause"),
    [("disk-sleep", "stuck in the kernel (D)"), ("gone", "gone")],
)
def test_d_state_and_gone_are_named_with_their_cause(state, cause):
    reports = by_host(waiting(0), waiting(1), waiting(2), waiting(3, state=state, answered=False))
    (suspect,) = name_suspects(reports, HOSTS).suspects
    assert suspect.rank == 3 and f" {cause} at step 7" in suspect.said


def test_a_host_that_did_not_answer_is_named_once_for_its_ranks():
    reports = {"h0": HostReport(ranks=(waiting(0), waiting(1))), "h1": None}
    (suspect,) = name_suspects(reports, HOSTS).suspects
    assert (suspect.host, suspect.rank, suspect.step) == ("h1", None, None)
    assert suspect.said == "hang suspect: host h1 did not answer (rank(s) 2-3)"


def test_a_rank_without_a_beacon_or_without_a_stack_is_named():
    reports = by_host(waiting(0), waiting(2), waiting(3, answered=False, stack=()))
    named = {s.rank: s.said for s in name_suspects(reports, HOSTS).suspects}
    assert named.keys() == {1, 3}
    assert named[1] == "hang suspect: rank 1 on h0 left no beacon while its peers did"
    assert "(pid 103) alive but wrote no stack at step 7" in named[3]


def test_no_stack_from_anyone_is_no_suspect_but_a_systemic_failure():
    # Nobody answered the dump (faulthandler not registered, say): that names no one by itself.
    reports = by_host(*(waiting(n, answered=False, stack=()) for n in range(4)))
    findings = name_suspects(reports, HOSTS)
    assert findings.suspects == ()
    assert findings.line == (
        "no suspect: every rank waits in step.tokens at step 7: "
        "the network or the collective library"
    )


def test_the_rank_outside_the_collective_its_peers_wait_in_is_named_with_its_stack():
    stall = ("faults.py:210 stall", "loop.py:118 train", "cli.py:40 main")
    reports = by_host(waiting(0), waiting(1), idle(2, phase="data", stack=stall), waiting(3))
    (suspect,) = name_suspects(reports, HOSTS).suspects
    assert suspect.said == (
        "hang suspect: rank 2 on h1 (pid 102) not in a collective at step 7, phase data, "
        "while 3 rank(s) wait in step.tokens; "
        "stack: faults.py:210 stall <- loop.py:118 train <- cli.py:40 main"
    )


def test_a_rank_outside_but_ahead_of_the_waiters_is_not_named():
    # Rank 3 finished step 8 and idles; the others wait in step 7: rank 3 holds no one up, but
    # rank 1, behind its schedule peers, does.
    reports = by_host(waiting(0), waiting(1, entered=10, left=9), waiting(2), idle(3, step=8))
    (suspect,) = name_suspects(reports, HOSTS).suspects
    assert suspect.rank == 1
    assert "behind at step 7, phase forward: waits in step.tokens after 10 collective(s), " in (
        suspect.said
    )
    assert "peers at step 7, phase forward, 12" in suspect.said


def test_behind_compares_only_ranks_of_one_schedule():
    # Pipeline stages issue different collectives: rank 1 (another schedule) with fewer is fine.
    reports = by_host(
        waiting(0, schedule_id=5),
        waiting(1, schedule_id=6, entered=3, left=2),
        waiting(2, schedule_id=5),
        waiting(3, schedule_id=5, step=6, phase="optimizer", entered=30, left=29),
    )
    (suspect,) = name_suspects(reports, HOSTS).suspects
    assert suspect.rank == 3  # step 6 < 7, whatever its count


def test_everyone_waiting_in_step_names_nobody():
    findings = name_suspects(by_host(*(waiting(n) for n in range(4))), HOSTS)
    assert findings.suspects == ()
    assert "every rank waits in step.tokens at step 7: the network" in findings.line


def test_nobody_in_a_collective_names_nobody():
    findings = name_suspects(by_host(*(idle(n, phase="data") for n in range(4))), HOSTS)
    assert findings.suspects == ()
    assert findings.line.startswith("no suspect: no rank waits in a collective (step 7, phase")


def test_no_beacon_at_all_and_stale_beacons_name_nobody():
    stale = idle(0, world_size=8)  # another attempt's world: says nothing about this one
    findings = name_suspects({"h0": HostReport(ranks=(stale,)), "h1": None}, HOSTS)
    assert findings.suspects == ()
    assert findings.line.startswith("no rank left a beacon (no answer from h1)")


def test_suspects_are_capped_and_the_line_says_how_many_more():
    hosts = ["h0"] * 40
    ranks = tuple(rank(n, world_size=40, state="stopped", answered=False) for n in range(40))
    findings = name_suspects({"h0": HostReport(ranks=ranks)}, hosts)
    assert len(findings.suspects) == 16 and findings.line.endswith(" and 24 more")


# --- the stack text ---------------------------------------------------------------------------


def test_the_main_threads_top_frames_are_parsed_from_a_real_dump(tmp_path):
    path = tmp_path / "stacks"
    ready, release = threading.Event(), threading.Event()

    def other_thread() -> None:
        ready.set()
        release.wait(10)

    worker = threading.Thread(target=other_thread)
    worker.start()
    ready.wait(10)
    with open(path, "wb") as file:

        def innermost() -> None:
            faulthandler.dump_traceback(file, all_threads=True)

        innermost()
    release.set()
    worker.join()
    text = path.read_text()
    assert "Thread 0x" in text  # the worker's block comes first
    frames = parse_stack(text, threading.main_thread().ident or 0)
    name = Path(__file__).name
    assert [frame.split(" ")[1] for frame in frames] == [
        "innermost",
        "test_the_main_threads_top_frames_are_parsed_from_a_real_dump",
        "pytest_pyfunc_call",
    ]
    assert frames[0].startswith(f"{name}:")


def test_a_thread_line_with_a_name_and_odd_frames_parse_strictly():
    text = (
        "Thread 0x0000000000000010 [worker] (most recent call first):\n"
        '  File "/a/b.py", line 3 in other\n'
        "\n"
        "Current thread 0x00000000000000ab [MainThread] (most recent call first):\n"
        "  <no Python frame>\n"
        '  File "/x/y\\tz.py", line 7 in f\x1b[31m\n'
        '  File "no-line.py", in g\n'
        '  File "/x/main.py", line 9 in <module>\n'
    )
    assert parse_stack(text, 0xAB) == ("y\\tz.py:7 f?[31m", "main.py:9 <module>")
    assert parse_stack(text, 0x10) == ("b.py:3 other",)
    assert parse_stack(text, 0x99) == ()


# --- a host's report, read back -------------------------------------------------------------


def test_a_report_round_trips():
    report = HostReport(ranks=(waiting(0), idle(1, stack=())), problems=("x: not a beacon",))
    assert read_report(report.to_json()) == report


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[]",
        "{",
        '{"ranks": [], "problems": [], "omitted": NaN}',
        '{"ranks": [], "problems": [], "omitted": 0, "extra": 1}',
        '{"ranks": [], "problems": ["\\u001b[2J"], "omitted": 0}',
        "x" * (forensics.MAX_REPORT_BYTES + 1),
    ],
)
def test_a_bad_report_is_refused(text):
    with pytest.raises(GoodputError):
        read_report(text)


@pytest.mark.parametrize(
    "changes",
    [
        {"rank": 4},
        {"phase": "sleeping"},
        {"last_site": "rm -rf"},
        {"state": "zombie"},
        {"stack": ["a", "b", "c", "d"]},
        {"stack": ["bad\nframe"]},
        {"pid": 0},
        {"entered": -1},
        {"answered": 1},
        {"step": True},
    ],
)
def test_a_bad_rank_in_a_report_is_refused(changes):
    raw = json.loads(HostReport(ranks=(waiting(0),)).to_json())
    raw["ranks"][0].update(changes)
    with pytest.raises(GoodputError):
        read_report(json.dumps(raw))


def test_a_report_too_big_drops_stacks_then_ranks():
    frames = ("f" * 150 + ".py:1 x",) * 3
    many = tuple(
        rank(n, world_size=1000, stack=tuple(f[:150] for f in frames)) for n in range(1000)
    )
    report = forensics.bounded(HostReport(ranks=many))
    assert len(report.to_json()) <= forensics.MAX_REPORT_BYTES
    assert report.omitted > 0 and len(report.ranks) + report.omitted == 1000
    assert all(r.stack == () for r in report.ranks)
    assert read_report(report.to_json()) == report


# --- collect_host on real processes -----------------------------------------------------------

# A rank: opens its beacon (world 3), enters a collective (rank 0) or stalls outside (rank 1),
# or spins in a loop (rank 2, which the test SIGSTOPs).
RANK = """
import sys, time
from goodput.beacon import open_beacon
from goodput.ranks import BEACON_DIR_VAR
rank = int(sys.argv[2])
beacon = open_beacon({BEACON_DIR_VAR: sys.argv[1]}, rank=rank, world_size=3, local_rank=rank,
                     host="localhost")
beacon.step(5)
beacon.phase("data" if rank == 1 else "forward")

def stall_in_data():
    print("ready", flush=True)
    while True:
        time.sleep(0.05)

def wait_in_all_reduce():
    with beacon.collective("step.grads"):
        stall_in_data()

(stall_in_data if rank else wait_in_all_reduce)()
"""


@pytest.fixture
def ranks(tmp_path):
    folder = tmp_path / "beacons"
    folder.mkdir(mode=0o700)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(folder), str(n)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(3)
    ]
    try:
        for process in processes:
            assert process.stdout is not None and process.stdout.readline() == "ready\n"
        yield folder, processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_collect_reads_each_rank_and_its_stack_and_names_the_stalled_one(ranks):
    folder, processes = ranks
    os.kill(processes[2].pid, signal.SIGSTOP)
    _wait_until_stopped(processes[2].pid)
    stack_file = beacon.stack_path(folder, 2)
    before = stack_file.stat().st_size
    started = time.monotonic()
    report = collect_host(folder, wait_s=3.0)
    assert time.monotonic() - started < 2.5  # the running ranks answered; nobody waited 3 s
    zero, one, two = report.ranks
    assert (zero.state, zero.answered, zero.waiting, zero.last_site) == (
        "running",
        True,
        True,
        "step.grads",
    )
    assert [f.split(" ")[1] for f in zero.stack] == [
        "stall_in_data",
        "wait_in_all_reduce",
        "<module>",
    ]
    assert (one.state, one.answered, one.waiting, one.phase) == ("running", True, False, "data")
    assert (two.state, two.answered, two.pid) == ("stopped", False, processes[2].pid)
    # The stopped rank was not signalled: woken, it writes nothing.
    os.kill(processes[2].pid, signal.SIGCONT)
    time.sleep(0.3)
    assert stack_file.stat().st_size == before
    (suspect,) = name_suspects({"localhost": report}, ["localhost"] * 3).suspects
    assert suspect.rank == 2 and "stopped (SIGSTOP) at step 5, phase forward" in suspect.said
    # Without the stopped rank, the one outside the collective is named, with its frames.
    fine = HostReport(ranks=(zero, one, zero.__class__(**{**_fields(zero), "rank": 2})))
    (suspect,) = name_suspects({"localhost": fine}, ["localhost"] * 3).suspects
    assert suspect.rank == 1 and "stack: rank.py:" in suspect.said
    assert "not in a collective at step 5, phase data, while 2 rank(s) wait in step.grads" in (
        suspect.said
    )


def _wait_until_stopped(pid: int) -> None:
    """SIGSTOP is delivered asynchronously: wait until /proc says T."""
    deadline = time.monotonic() + 10
    while forensics.proc_state(pid, _start_ticks(pid)) != "stopped":
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _start_ticks(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_bytes()
    return int(text[text.rindex(b")") + 2 :].split()[19])


def _fields(report: RankReport) -> dict[str, object]:
    return {name: getattr(report, name) for name in report.__dataclass_fields__}


def test_a_beacon_naming_another_process_is_not_signalled(ranks, tmp_path):
    # A forged beacon (rank 0's, with a pid changed to a process that is not the rank) must not
    # get the dump signal: SIGUSR2 would kill this "sleep", which has no handler for it.
    folder, processes = ranks
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        image = bytearray(beacon.beacon_path(folder, 0).read_bytes())
        at = image.find(struct.pack("<IIII", 0, 3, processes[0].pid, 0))
        assert at > 0
        image[at : at + 16] = struct.pack("<IIII", 0, 3, bystander.pid, 0)
        forged = tmp_path / "forged"
        forged.mkdir(mode=0o700)
        beacon.beacon_path(forged, 0).write_bytes(bytes(image))
        beacon.stack_path(forged, 0).write_bytes(beacon.STACK_HEADER)
        (zero,) = collect_host(forged, wait_s=0.5).ranks
        assert zero.state == "gone" and not zero.answered
        time.sleep(0.2)
        assert bystander.poll() is None  # still alive: never signalled
    finally:
        bystander.kill()
        bystander.wait()


def test_hostile_files_in_the_folder_are_problems_not_ranks(ranks):
    folder, _ = ranks
    (folder / "rank-00007.beacon").symlink_to(beacon.beacon_path(folder, 0))
    (folder / "rank-00008.beacon").write_bytes(beacon.beacon_path(folder, 1).read_bytes())
    (folder / "rank-00009.beacon").write_bytes(os.urandom(256))
    (folder / "notes.txt").write_text("ignored")
    report = collect_host(folder, wait_s=1.0)
    assert [r.rank for r in report.ranks] == [0, 1, 2]
    problems = " | ".join(report.problems)
    assert "rank-00007.beacon: not a goodput beacon: cannot open it" in problems
    assert "rank-00008.beacon: holds rank 1's beacon" in problems
    assert "rank-00009.beacon: not a goodput beacon" in problems
    assert "notes" not in problems


def test_a_missing_or_foreign_folder_is_a_problem(tmp_path):
    assert collect_host(tmp_path / "none", 0.1).problems == (
        f"{tmp_path / 'none'}: no beacon folder on this host",
    )
    (tmp_path / "link").symlink_to(tmp_path)
    (problem,) = collect_host(tmp_path / "link", 0.1).problems
    assert problem.endswith("not a folder of this user")


def test_the_collect_command_of_the_docs_prints_the_report(ranks):
    folder, _ = ranks
    docs = (Path(__file__).resolve().parents[3] / "docs" / "launch.md").read_text()
    (line,) = [x for x in command_lines(docs) if x.startswith("python -m goodput.launch.forensics")]
    argv = shlex.split(line.replace("DIR", str(folder)))
    result = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == ""
    assert [r.rank for r in read_report(result.stdout).ranks] == [0, 1, 2]
    bad = subprocess.run(
        [sys.executable, "-m", "goodput.launch.forensics", "collect", "--dir", "relative"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("forensics: python -m goodput.launch.forensics: --dir must be")


def test_waiters_with_a_rank_done_ahead_of_them_name_nobody():
    reports = by_host(waiting(0), waiting(1), waiting(2), idle(3, step=8, phase="done"))
    findings = name_suspects(reports, HOSTS)
    assert findings.suspects == ()
    assert findings.line == (
        "no suspect: 3 of 4 ranks wait, none behind, in step.tokens at step 7: "
        "the network or the collective library"
    )
