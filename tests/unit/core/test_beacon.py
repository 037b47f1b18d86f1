"""The per-rank beacon (``goodput.beacon``): what a rank writes reads back; a torn update is
flagged, not lost; another process reads it live, and still reads it while the writer is
SIGSTOPped; the stack dump lands on DUMP_SIGNAL; a rank deletes only its own files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from goodput import beacon as beacon_module
from goodput.beacon import (
    DUMP_SIGNAL,
    FR_POLL_S,
    STACK_HEADER,
    beacon_path,
    current,
    fr_path,
    open_beacon,
    read_beacon,
    stack_path,
)
from goodput.errors import GoodputError
from goodput.ranks import BEACON_DIR_VAR

SEQ_AT = 16  # the seqlock's offset, after magic, version, size and 4 reserved bytes

# A rank in a child process: open its beacon, then obey one command a line on stdin.
CHILD = """
import sys, time
from goodput.beacon import current, open_beacon
from goodput.ranks import BEACON_DIR_VAR
beacon = open_beacon({BEACON_DIR_VAR: sys.argv[1]}, rank=1, world_size=4, local_rank=1, host="nid7")
beacon.phase("data")
print("open", flush=True)
for line in sys.stdin:
    command, _, argument = line.strip().partition(" ")
    if command == "step":
        beacon.step(int(argument))
    elif command == "spin":  # update as fast as it can until stopped from outside
        for n in range(10**9):
            beacon.step(n)
    elif command == "close":
        beacon.close()
    print("done", command, flush=True)
"""


@pytest.fixture
def opened(tmp_path):
    beacon = open_beacon(
        {BEACON_DIR_VAR: str(tmp_path)},
        rank=3,
        world_size=8,
        local_rank=1,
        host="nid0012",
        schedule_id=77,
    )
    assert beacon is current()
    try:
        yield beacon
    finally:
        beacon.close()


def _start_ticks(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_bytes()
    return int(text[text.rindex(b")") + 2 :].split()[19])


def test_round_trip(opened, tmp_path):
    opened.step(41)
    opened.phase("backward")
    with opened.collective("step.tokens"), opened.collective("fsdp.all_gather"):
        time.sleep(0.01)  # nested: the wait counts once
    with opened.flush_collective("ckpt.flush"):
        pass
    state = read_beacon(beacon_path(tmp_path, 3))
    assert (state.rank, state.world_size, state.local_rank) == (3, 8, 1)
    assert (state.pid, state.host, state.schedule_id) == (os.getpid(), "nid0012", 77)
    assert state.start_ticks == _start_ticks(os.getpid())
    assert state.main_thread_id == threading.main_thread().ident
    assert (state.step, state.phase, state.last_site) == (41, "backward", "fsdp.all_gather")
    assert 10**7 <= state.waited_ns == opened.waited_ns < 10**9
    assert state.entered - state.left == 0 and state.entered >= 2
    assert (state.flush_site, state.flush_entered - state.flush_left) == ("ckpt.flush", 0)
    assert state.phase_since_ns <= state.updated_ns <= time.monotonic_ns()
    assert not state.torn
    assert stack_path(tmp_path, 3).read_bytes() == STACK_HEADER


def test_the_schedule_id_is_set_once_the_layout_is_built(opened, tmp_path):
    opened.step(5)
    opened.set_schedule(2**64 + 9)  # kept to 64 bits, as open_beacon keeps it
    state = read_beacon(beacon_path(tmp_path, 3))
    assert (state.schedule_id, state.step, state.rank, state.host) == (9, 5, 3, "nid0012")
    assert not state.torn and state.entered == state.left


def test_counts_in_memory_before_and_after_the_file(tmp_path):
    beacon = current()
    before = beacon.waited_ns
    with beacon.collective("eval.sums"):
        time.sleep(0.005)
    assert beacon.waited_ns - before >= 5 * 10**6  # no file: counted all the same
    assert open_beacon({}, rank=0, world_size=1, local_rank=0, host="h") is None
    opened = open_beacon(
        {BEACON_DIR_VAR: str(tmp_path)}, rank=0, world_size=1, local_rank=0, host="h"
    )
    assert opened is beacon
    assert read_beacon(beacon_path(tmp_path, 0)).waited_ns == beacon.waited_ns  # carried over
    beacon.close()
    with beacon.collective("eval.sums"):
        pass  # still counting after close
    assert sorted(os.listdir(tmp_path)) == []


def test_an_odd_seq_reads_as_torn(opened, tmp_path):
    opened.step(9)
    path = beacon_path(tmp_path, 3)
    with open(path, "r+b") as file:  # a writer stopped between its two seq stores
        file.seek(SEQ_AT)
        seq = int.from_bytes(file.read(8), "little")
        file.seek(SEQ_AT)
        file.write((seq + 1).to_bytes(8, "little"))
    state = read_beacon(path)
    assert state.torn and state.step == 9


def test_unknown_names_and_bad_folders_are_refused(tmp_path):
    with pytest.raises(ValueError, match="step.nope"):
        current().collective("step.nope")
    with pytest.raises(ValueError, match="lunch"):
        current().phase("lunch")
    with pytest.raises(GoodputError, match="absolute"):
        open_beacon({BEACON_DIR_VAR: "relative/dir"}, rank=0, world_size=1, local_rank=0, host="h")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(GoodputError, match="symlink"):
        environ = {BEACON_DIR_VAR: str(tmp_path / "link")}
        open_beacon(environ, rank=0, world_size=1, local_rank=0, host="h")


def test_close_unlinks_only_its_own_files(opened, tmp_path):
    path = beacon_path(tmp_path, 3)
    stranger = tmp_path / "stranger"
    stranger.write_bytes(b"not ours")
    os.replace(stranger, path)  # someone else's file now holds the beacon's name
    opened.close()
    assert path.read_bytes() == b"not ours"
    assert not stack_path(tmp_path, 3).exists()
    assert opened.path is None


def _until(condition) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _child(tmp_path: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(beacon_module.__file__).parents[1],
    )
    assert child.stdout is not None and child.stdout.readline() == "open\n"
    return child


def _tell(child: subprocess.Popen[str], line: str) -> None:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(line + "\n")
    child.stdin.flush()
    if line != "spin":
        assert child.stdout.readline() == f"done {line.split()[0]}\n"


def test_another_process_reads_the_live_beacon_and_its_stacks(tmp_path):
    child = _child(tmp_path)
    try:
        path = beacon_path(tmp_path, 1)
        _tell(child, "step 5")
        first = read_beacon(path)
        assert (first.pid, first.step, first.phase, first.host) == (child.pid, 5, "data", "nid7")
        _tell(child, "step 6")
        assert read_beacon(path).step == 6  # the shared mapping: no write, no rename
        stacks = stack_path(tmp_path, 1)
        os.kill(child.pid, DUMP_SIGNAL)  # the child is blocked reading stdin, in C
        main_thread = f"hread {first.main_thread_id:#018x}"  # "Thread" or "Current thread"
        _until(lambda: main_thread in stacks.read_text())
        assert stacks.read_text().startswith(STACK_HEADER.decode())
        _tell(child, "close")
        assert sorted(os.listdir(tmp_path)) == []
    finally:
        child.kill()
        child.wait()


def test_a_sigstopped_rank_keeps_a_readable_beacon(tmp_path):
    child = _child(tmp_path)
    try:
        path = beacon_path(tmp_path, 1)
        _tell(child, "spin")
        _until(lambda: read_beacon(path).step >= 1000)
        os.kill(child.pid, signal.SIGSTOP)
        _until(lambda: Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] == "T")
        stopped = read_beacon(path)
        time.sleep(0.05)
        again = read_beacon(path)
        assert again == stopped and again.step >= 1000  # frozen, still readable
        assert again.start_ticks == _start_ticks(child.pid)
    finally:
        child.kill()
        child.wait()


# A gloo rank of one with torch's flight recorder on, blocked on stdin after one all-reduce.
FLIGHT_CHILD = """
import sys, tempfile
import torch, torch.distributed as dist
from goodput.beacon import open_beacon
from goodput.ranks import BEACON_DIR_VAR
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
environ = {BEACON_DIR_VAR: sys.argv[1], "TORCH_FR_BUFFER_SIZE": "64"}
beacon = open_beacon(environ, rank=0, world_size=1, local_rank=0, host="h")
dist.all_reduce(torch.ones(2))
print("open", flush=True)
sys.stdin.readline()
beacon.close()
print("done close", flush=True)
"""


def test_the_flight_record_follows_a_stack_dump(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", FLIGHT_CHILD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(beacon_module.__file__).parents[1],
        env={**os.environ, "TORCH_FR_BUFFER_SIZE": "64"},  # torch reads it at start
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "open\n"
        record = fr_path(tmp_path, 0)
        time.sleep(2 * FR_POLL_S)
        assert not record.exists()  # nothing before a dump
        os.kill(child.pid, DUMP_SIGNAL)
        _until(record.exists)
        entries = json.loads(record.read_bytes())["entries"]
        assert [e["profiling_name"] for e in entries] == ["gloo:all_reduce"]
        _tell(child, "close")
        assert sorted(os.listdir(tmp_path)) == []
    finally:
        child.kill()
        child.wait()


def test_opening_again_moves_the_beacon(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    beacon = open_beacon({BEACON_DIR_VAR: str(first)}, rank=0, world_size=2, local_rank=0, host="a")
    assert beacon is not None
    beacon.step(3)
    try:
        environ = {BEACON_DIR_VAR: str(second)}
        assert open_beacon(environ, rank=1, world_size=2, local_rank=1, host="b") is beacon
        assert os.listdir(first) == []  # the first run's files went with it
        state = read_beacon(beacon_path(second, 1))
        assert (state.rank, state.host, state.step) == (1, "b", 3)
    finally:
        beacon.close()
