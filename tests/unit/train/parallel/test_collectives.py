"""FSDP2's all-gathers and reduce-scatters counted in the beacon (``parallel/collectives.py``):
the same bits as FSDP's own comms, the same counts on every rank, and a peer's lag shows up as this
rank's wait inside them (2 gloo ranks)."""

import time

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

from goodput.beacon import beacon_path, open_beacon, read_beacon
from goodput.ranks import BEACON_DIR_VAR
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL, rank_micro_batches, uneven_global_batch
from goodput.train.config.parallel import ParallelConfig
from goodput.train.model import Transformer
from goodput.train.parallel.collectives import CountedAllGather, CountedReduceScatter
from goodput.train.parallel.grad_tally import GradientTally
from goodput.train.parallel.parallelize import parallelize
from goodput.train.step import StepSettings, train_step

STEPS = 2
ACCUMULATION = 2
LAG_S = 0.1  # each micro-batch


def _lag(module, args):
    time.sleep(LAG_S)


def _counters(path):
    state = read_beacon(path)
    return state.entered, state.left, state.waited_ns


def _train(rank, world_size, counted, path):
    """STEPS steps; rank 1 lags LAG_S in the second block's forward of each micro-batch. Returns
    the losses, the final weights, the beacon file's counter deltas and the tallies."""
    torch.manual_seed(0)
    tally = GradientTally() if counted else None
    model = parallelize(Transformer(TINY_MODEL), ParallelConfig(precision="fp32"), tally=tally)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert all(
        isinstance(m._get_fsdp_state()._fsdp_param_group._all_gather_comm, CountedAllGather)
        and isinstance(
            m._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm, CountedReduceScatter
        )
        for m in units
    )
    if not counted:  # FSDP's own comms, as before this module
        for unit in units:
            unit.set_custom_all_gather(DefaultAllGather())
            unit.set_custom_reduce_scatter(DefaultReduceScatter())
    if rank == 1:
        list(model.blocks.values())[1].register_forward_pre_hook(_lag)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _counters(path)
    losses, tallies = [], []
    for _ in range(STEPS):
        micro = rank_micro_batches(*uneven_global_batch(), rank, world_size, ACCUMULATION)
        result = train_step(model, optimizer, micro, StepSettings(max_grad_norm=1.0, tally=tally))
        losses.append(result.loss)
        tallies.append(result.small_batch_sq_norm)
    weights = [p.full_tensor().clone() for p in model.parameters()]
    entered, left, waited = (now - then for now, then in zip(_counters(path), before, strict=True))
    return losses, weights, entered, left, waited, tallies


def _both(rank, world_size, directory):
    environ = {BEACON_DIR_VAR: directory}
    beacon = open_beacon(environ, rank=rank, world_size=world_size, local_rank=rank, host="h")
    assert beacon is not None
    path = beacon_path(directory, rank)
    try:
        return _train(rank, world_size, False, path), _train(rank, world_size, True, path)
    finally:
        beacon.close()


def test_counted_comms_keep_the_bits_and_count_alike_on_every_rank(tmp_path):
    (plain0, counted0), (plain1, counted1) = run_distributed(_both, 2, str(tmp_path))
    for plain, counted in ((plain0, counted0), (plain1, counted1)):
        assert plain[0] == counted[0]  # the losses, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(plain[1], counted[1], strict=True))
        assert all(t is not None and t > 0 for t in counted[5])  # the tally still fed
    units = 1 + TINY_MODEL.num_layers
    # Each step: every unit gathered at least once and reduce-scattered once, per counted run.
    fsdp_brackets = counted0[2] - plain0[2]
    assert fsdp_brackets >= STEPS * 2 * units
    assert counted0[2:4] == counted1[2:4] and plain0[2:4] == plain1[2:4]  # same counts
    assert counted0[2] == counted0[3]  # every bracket left
    # Rank 1 lags in forward: rank 0 waits for it inside an FSDP all-gather, which only the
    # counted comms see; rank 1 itself hardly waits.
    lag_ns = STEPS * ACCUMULATION * LAG_S * 1e9
    assert counted0[4] > 0.8 * lag_ns > plain0[4]
    assert counted1[4] < 0.5 * lag_ns
