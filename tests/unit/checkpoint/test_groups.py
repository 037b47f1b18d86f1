"""goodput's own process groups (``checkpoint.groups``) on real gloo ranks: the real checkpointer
and snapshot store make theirs without connecting every pair — the same sockets at 2 and 4 ranks
— and still save and exchange snapshots; a gloo group made afterwards connects its pairs when
it is made, as before, and the environment is left as it was."""

import os

import pytest
import torch.distributed as dist

from goodput.checkpoint.groups import LAZY_INIT_VAR
from goodput.testing.dist import run_distributed
from goodput.testing.sockets import group_sockets, settled_socket_inodes


def made_and_used(rank: int, world_size: int, tmp: str) -> dict:
    before = os.environ.get(LAZY_INIT_VAR)
    sockets = group_sockets(rank, world_size, tmp, eager=False)
    after = os.environ.get(LAZY_INIT_VAR)
    dist.barrier()
    alone = settled_socket_inodes()
    plain = dist.new_group(backend="gloo")
    # The sockets new since, not a count's difference: the checkpointer's and the store's close
    # late, after their groups are destroyed (a full suite saw 3 made and 2 closed).
    plain_sockets = len(settled_socket_inodes() - alone)
    dist.barrier()
    dist.destroy_process_group(plain)
    return {"sockets": sockets, "env": (before, after), "plain": plain_sockets}


@pytest.mark.parametrize("world_size", [2, 4])
def test_goodput_groups_connect_only_what_they_use(world_size, tmp_path):
    results = run_distributed(made_and_used, world_size, str(tmp_path))
    for rank, result in enumerate(results):
        sockets = result["sockets"]
        # Made: each group's listening socket, and the snapshot store's ring neighbours (its
        # first all-gather, which makes every rank agree its folder is usable): 2 + 2 at any
        # W > 2. Connected in full, as before, the two groups held 2 W.
        assert sockets.made - sockets.default == 2 + min(2, world_size - 1), rank
        assert sockets.saved and sockets.snapshot_ok, rank
        assert result["env"][0] == result["env"][1], rank
        # torch's default for any other gloo group still connects its pairs when it is made: a
        # lazy one would hold its listening socket alone: a full mesh's is it and one per peer.
        assert result["plain"] == world_size, rank
