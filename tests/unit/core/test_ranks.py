"""The launcher <-> rank contract's host file (``goodput.ranks``): ranks launched by goodput read
the attempt's hosts from the file ``GOODPUT_HOSTFILE`` names, once per process, strictly; a file
that cannot be read or is no host file the launcher wrote is one line naming it (never a rank
that guesses its host, which would pair snapshots differently from its peers); ranks started by
something else name this machine."""

from __future__ import annotations

import os
import sys

import pytest

from goodput.errors import GoodputError
from goodput.launch.launchers import write_hosts
from goodput.ranks import (
    HOSTFILE_VAR,
    MAX_HOSTS,
    MAX_LAUNCH_HOSTS_BYTES,
    every_rank_host,
    launch_hosts,
    rank_host,
    this_host,
)


def launched(path, ranks_per_host="2"):
    return {HOSTFILE_VAR: str(path), "LOCAL_WORLD_SIZE": ranks_per_host}


def test_ranks_goodput_did_not_launch_name_this_machine():
    assert launch_hosts({}) is None and every_rank_host(4, {}) is None
    local = os.uname().nodename.split(".")[0]
    assert rank_host(3, {"LOCAL_WORLD_SIZE": "2"}) == this_host() == local


def test_every_rank_host_is_the_files_line_rank_over_ranks_per_host(tmp_path):
    path = write_hosts(tmp_path, ["n0.cluster.org", "n1", "n2.cluster.org"])
    env = launched(path)
    assert launch_hosts(env) == ("n0.cluster.org", "n1", "n2.cluster.org")
    assert every_rank_host(5, env) == ("n0", "n0", "n1", "n1", "n2")
    assert [rank_host(rank, env) for rank in range(6)] == ["n0", "n0", "n1", "n1", "n2", "n2"]


def test_the_expanded_hosts_share_one_string_a_host(tmp_path):
    # Aurora: 127,488 ranks, 12 a host on 10,624 hosts: 10,624 strings, not 127,488.
    names = [f"x{1000 + i // 64}c{i // 8 % 8}s{i % 8}b0n0" for i in range(10_624)]
    every = every_rank_host(127_488, launched(write_hosts(tmp_path, names), "12"))
    assert every is not None and len(every) == 127_488 and every[-1] == names[-1]
    assert len({id(host) for host in every}) == 10_624
    assert sys.getsizeof(every) < 1.1e6  # one reference a rank


def test_the_file_is_read_once_per_process(tmp_path):
    path = write_hosts(tmp_path, ["n0", "n1"])
    assert launch_hosts(launched(path)) == ("n0", "n1")
    path.unlink()  # the launcher names files by their contents: one path, one list
    assert rank_host(3, launched(path)) == "n1"


def _refused(env, rank=0):
    with pytest.raises(GoodputError) as refused:
        rank_host(rank, env)
    assert "\n" not in refused.value.render()
    return refused.value


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda p: None, "No such file"),
        (lambda p: p.mkdir(), "is a folder"),
        (lambda p: p.symlink_to(p), "Too many levels of symbolic links"),
        (lambda p: os.mkfifo(p), "not a regular file"),
        (lambda p: p.write_bytes(b"n0\n\xff\n"), "not valid UTF-8"),
        (lambda p: p.write_text(""), "names no host"),
        (lambda p: p.write_text("n0\nn1"), "does not end with a newline"),
        (lambda p: p.write_text("n0\n\nn1\n"), "'' is not a host name"),
        (lambda p: p.write_text("n0\nn1 # a comment\n"), "'n1 # a comment' is not a host name"),
        (lambda p: p.write_text("n0\r\nn1\r\n"), "is not a host name"),
        (lambda p: p.write_text("n0\n-n1\n"), "'-n1' is not a host name"),
        (lambda p: p.write_text("n0\nn0\n"), "names a host twice"),
        (lambda p: p.write_text("n\n" * (MAX_HOSTS + 1)), "more than 100,000 hosts"),
    ],
)
def test_a_broken_host_file_is_one_line_naming_it(tmp_path, make, what):
    path = tmp_path / "hostfile-broken"
    make(path)
    error = _refused(launched(path))
    assert error.where.startswith(f"{HOSTFILE_VAR} {path}") and what in error.what
    assert "goodput launch" in error.fix


def test_a_huge_host_file_is_refused_unread(tmp_path):
    path = tmp_path / "hostfile-huge"
    with open(path, "wb") as f:
        f.truncate(MAX_LAUNCH_HOSTS_BYTES + 1)  # sparse: nothing of it is read
    assert "is larger than" in _refused(launched(path)).render()


def test_a_relative_path_is_refused():
    assert _refused(launched("hostfile-x")).what == "is not an absolute path"


def test_too_few_hosts_for_the_ranks_is_one_line(tmp_path):
    env = launched(write_hosts(tmp_path, ["n0", "n1"]))
    assert rank_host(3, env) == "n1"
    error = _refused(env, rank=4)
    assert error.what == "names 2 hosts, but rank 4 at LOCAL_WORLD_SIZE=2 runs on host 3"
    with pytest.raises(GoodputError, match="rank 4 at LOCAL_WORLD_SIZE=2 runs on host 3"):
        every_rank_host(5, env)


@pytest.mark.parametrize("per_host", ["", "0", "x", "-1", "1" * 12])
def test_launched_ranks_need_their_ranks_per_host(tmp_path, per_host):
    env = launched(write_hosts(tmp_path, ["n0"]), per_host)
    if not per_host:
        del env["LOCAL_WORLD_SIZE"]
    assert _refused(env).where == "LOCAL_WORLD_SIZE"
