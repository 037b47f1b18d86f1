"""Who holds whose in-memory checkpoint (``goodput.checkpoint.snapshot.pairing``): the pairing
of ranks across hosts and the restart's choice (``newest_complete``) against brute force."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from goodput.checkpoint.snapshot.pairing import Pairing, hosts_shape, newest_complete

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)


def test_pairing_examples():
    hosts = ["n1", "n1", "n2", "n2", "n3", "n3"]
    assert Pairing.from_hosts(hosts, 1) == Pairing(holder=3, source=5, num_hosts=3)
    assert Pairing.from_hosts(hosts, 4) == Pairing(holder=0, source=2, num_hosts=3)
    assert Pairing.from_hosts(["n2", "n1"], 0) == Pairing(holder=1, source=1, num_hosts=2)
    assert Pairing.from_hosts(["n1", "n1"], 0) == Pairing(holder=None, source=None, num_hosts=1)
    assert Pairing.from_hosts(["n1", "n1", "n2"], 2) == Pairing(
        holder=None, source=None, num_hosts=2
    )
    assert hosts_shape(hosts) == (3, 2) and hosts_shape(["n1", "n1", "n2"]) == (2, 0)


@st.composite
def _host_lists(draw: st.DrawFn) -> list[str]:
    """Every rank's host: H hosts of ppn ranks each, the ranks in any order."""
    num_hosts, ppn = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    return draw(st.permutations([f"n{h}" for h in range(num_hosts) for _ in range(ppn)]))


@PROPERTY
@given(hosts=_host_lists())
def test_a_partner_copy_is_always_on_another_host_and_pairs_are_inverse(hosts):
    pairings = [Pairing.from_hosts(hosts, rank) for rank in range(len(hosts))]
    if len(set(hosts)) == 1:
        assert all(p.holder is None and p.source is None for p in pairings)
        return
    for rank, pairing in enumerate(pairings):
        assert pairing.holder is not None and pairing.source is not None
        assert hosts[pairing.holder] != hosts[rank]
        assert pairings[pairing.holder].source == rank
    assert {p.holder for p in pairings} == set(range(len(hosts)))  # each rank holds one copy


_STEPS = st.lists(st.integers(-1, 6), max_size=2)


@PROPERTY
@given(data=st.data(), hosts=_host_lists(), at_least=st.integers(-1, 6))
def test_newest_complete_is_the_brute_force_answer(data, hosts, at_least):
    world = len(hosts)
    own = [data.draw(_STEPS) for _ in range(world)]
    held = [data.draw(_STEPS) for _ in range(world)]
    holders = [Pairing.from_hosts(hosts, rank).holder for rank in range(world)]

    def loadable(step: int, rank: int) -> bool:
        holder = holders[rank]
        return step in own[rank] or (holder is not None and step in held[holder])

    expected = next(
        (
            s
            for s in range(6, max(at_least, 0) - 1, -1)
            if all(loadable(s, r) for r in range(world))
        ),
        None,
    )
    assert newest_complete(own, held, holders, at_least=at_least) == expected


def test_newest_complete_reads_a_lost_hosts_ranks_from_their_partners():
    hosts = ["n1", "n2"]
    holders = [Pairing.from_hosts(hosts, rank).holder for rank in range(2)]
    # n2 was replaced: rank 1 has nothing of its own; rank 0 holds rank 1's steps 4 and 6.
    own, held = [[4, 6], []], [[4, 6], []]
    assert newest_complete(own, held, holders, at_least=0) == 6
    assert newest_complete(own, held, holders, at_least=7) is None
    assert newest_complete([[6], [-1]], [[-1], [6]], holders, at_least=0) is None
