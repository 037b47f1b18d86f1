"""Fuzz the readers of host lists: Slurm node lists (``SLURM_JOB_NODELIST``), PBS node files and
``--hostfile`` files, ``--hosts`` lists, the scheduler's numbers in the environment, and the
attempt's host file a launched rank reads (``GOODPUT_HOSTFILE``, ``goodput.ranks``).

Property: a valid result (every host a whole valid name, at most ``MAX_HOSTS`` of them) or a
one-line ``GoodputError``; never another exception, a hang or a list beyond the bound. Node lists
come three ways: built from parts with the hosts they must expand to (zero padding, several
groups, commas), random text over the node-list alphabet (nested and unmatched brackets,
backward and huge ranges), and any text at all.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.launch.broadcast import read_hosts
from goodput.launch.env import (
    MAX_HOSTS,
    expand_nodelist,
    parse_hostfile,
    read_hostfile,
    read_placement,
)
from goodput.ranks import HOSTFILE_VAR, HOSTNAME, every_rank_host, rank_host

MAX_SECONDS = 2.0  # per input: the bound is checked by counting, never by building the list


def valid_or_refused(read, *args):
    """``read(*args)``, checked: valid hosts within the bound, or one line of GoodputError."""
    began = time.monotonic()
    try:
        hosts = read(*args)
    except GoodputError as error:
        assert "\n" not in error.render()
        hosts = None
    assert time.monotonic() - began < MAX_SECONDS
    if hosts is not None:
        assert len(hosts) <= MAX_HOSTS and len(set(hosts)) == len(hosts)
        assert all(HOSTNAME.fullmatch(host) for host in hosts)
    return hosts


prefixes = st.text("abcnidx-.", min_size=1, max_size=6).filter(lambda s: s[0].isalpha())
suffixes = st.text("abcs0123.", max_size=4)


@st.composite
def node_ranges(draw):
    """A bracket group's body and the numbers it stands for, as text."""
    parts, numbers = [], []
    for _ in range(draw(st.integers(1, 3))):
        width = draw(st.integers(1, 4))
        low = draw(st.integers(0, 10**width - 1))
        high = draw(st.integers(low, min(low + 5, 10**width - 1)))
        text = f"{low:0{width}d}"
        parts.append(text if low == high and draw(st.booleans()) else f"{text}-{high}")
        numbers += [f"{n:0{width}d}" for n in range(low, high + 1)]
    return ",".join(parts), numbers


@st.composite
def node_lists(draw):
    """A well-formed node list and the hosts it must expand to, in order."""
    entries, hosts = [], []
    for index in range(draw(st.integers(1, 3))):
        prefix = f"{draw(prefixes)}{index}"  # entries differ, so their hosts cannot repeat
        names = [prefix]
        entry = prefix
        for _ in range(draw(st.integers(0, 2))):
            body, numbers = draw(node_ranges())
            suffix = draw(suffixes)
            entry += f"[{body}]{suffix}"
            names = [f"{name}{number}{suffix}" for name in names for number in numbers]
        entries.append(entry)
        hosts += names
    return ",".join(entries), hosts


@given(node_lists())
def test_well_formed_node_lists_expand_to_their_hosts(case):
    spec, hosts = case
    if len(set(hosts)) == len(hosts):  # a group like [1,01] names one host twice
        assert valid_or_refused(expand_nodelist, spec) == hosts
    else:
        assert valid_or_refused(expand_nodelist, spec) is None


@given(st.text("x1[]-,09\n ", max_size=40) | st.text(max_size=40))
def test_any_node_list_is_expanded_or_refused(spec):
    valid_or_refused(expand_nodelist, spec)


@given(st.lists(st.integers(0, 10**18), min_size=2, max_size=6), st.sampled_from(["-", ","]))
def test_huge_ranges_are_refused_without_building_the_list(numbers, separator):
    body = separator.join(map(str, sorted(numbers)))
    valid_or_refused(expand_nodelist, f"x[{body}]y[{body}]")


host_lines = st.lists(
    st.one_of(
        st.from_regex(HOSTNAME, fullmatch=True).map(lambda name: name[:20]),
        st.sampled_from(["", "  ", "# comment", "x1 # rank 2", "x1\r", "a b", "-oProxy=x"]),
        st.text(max_size=12),
    ),
    max_size=12,
)


@given(host_lines)
def test_host_file_text_is_parsed_or_refused(lines):
    valid_or_refused(parse_hostfile, "\n".join(lines), "hosts")


@given(st.binary(max_size=200) | host_lines.map(lambda lines: "\n".join(lines).encode()))
def test_host_files_and_pbs_node_files_are_read_or_refused(tmp_path_factory, data):
    path = Path(tmp_path_factory.mktemp("hosts")) / "nodefile"
    path.write_bytes(data)
    valid_or_refused(read_hostfile, path)
    valid_or_refused(read_hosts, None, path)
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return  # read_hostfile refused it above; read_placement gets text
    env = {"PBS_JOBID": "1.pbs", "PBS_NODEFILE": str(path)}
    valid_or_refused(lambda: read_placement(env, text).hosts)


@given(st.text(max_size=60))
def test_host_lists_are_read_or_refused(hosts):
    valid_or_refused(read_hosts, hosts, None)


numbers = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["", " 1", "1 ", "+1", "1_0", "٣", "²", "0x10", "4(x2)", "2(x3),1", "1e3"]),
    st.text("0123456789(x),-", max_size=12),
)
variables = st.sampled_from(
    [
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "PMI_RANK",
        "PMI_SIZE", "PALS_RANKID", "PALS_LOCAL_SIZE", "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
        "MPI_LOCALNRANKS", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "MASTER_ADDR",
    ]
)  # fmt: skip


@given(st.dictionaries(variables, numbers, max_size=6))
def test_the_environment_gives_a_placement_or_is_refused(env):
    try:
        placement = read_placement(env)
    except GoodputError as error:
        assert "\n" not in error.render()
        return
    assert 0 <= placement.rank < placement.world_size
    assert 1 <= placement.master_port <= 65535
    assert 1 <= len(placement.hosts) <= MAX_HOSTS


@given(
    st.binary(max_size=200)
    | host_lines.map(lambda lines: "".join(f"{line}\n" for line in lines).encode())
    | st.lists(st.from_regex(HOSTNAME, fullmatch=True), min_size=1, max_size=6, unique=True).map(
        lambda names: "".join(f"{name}\n" for name in names).encode()
    ),
    st.sampled_from(["1", "2", "3"]) | st.sampled_from(["0", "", "x", "-3", "12", "9" * 10]),
    st.integers(1, 12),
)
def test_a_launched_ranks_host_file_gives_every_ranks_host_or_is_refused(
    tmp_path_factory, data, per_host, world_size
):
    # Named by its contents, as the launcher names it: a rank reads one path once.
    path = tmp_path_factory.getbasetemp() / f"hostfile-{hashlib.sha256(data).hexdigest()}"
    path.write_bytes(data)
    env = {HOSTFILE_VAR: str(path), "LOCAL_WORLD_SIZE": per_host}
    try:
        every = every_rank_host(world_size, env)
    except GoodputError as error:
        assert "\n" not in error.render()
        return
    lines = data.decode().splitlines()
    assert every is not None and len(every) == world_size
    assert every == tuple(lines[rank // int(per_host)].split(".")[0] for rank in range(world_size))
    assert every[-1] == rank_host(world_size - 1, env)
