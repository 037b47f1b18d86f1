"""The step cost the planner ranks layouts by (``goodput.plan.cost``), term by term on small
shapes with the arithmetic done by hand in the comments, and which groups cross hosts."""

from __future__ import annotations

import pytest

from goodput.plan.cost import Rates, step_cost
from goodput.plan.layout import Layout, spans_hosts
from goodput.plan.memory import Workload
from goodput.train.config.model import ModelConfig

# 4 layers of d 256, 8 heads of 32, 4 kv heads (kv 128), ffn 768, vocabulary 1000, untied.
# Per block: attention 256 x 32 x (16 + 8) = 196,608; MLP 3 x 256 x 768 = 589,824; norms 512:
# 786,944. Embedding = head = 256,000; final norm 256. Total 4 x 786,944 + 512,256 = 3,660,032.
MODEL = ModelConfig(
    vocab_size=1000, dim=256, num_layers=4, num_heads=8, num_kv_heads=4, ffn_dim=768
)
TOTAL = 3_660_032
# FLOPs per token at seq 64: 6 x (total - embedding) + 12 x 4 x 256 x 64 = 6 x 3,404,032 +
# 786,432 = 21,210,624. A step of 16 x 64 = 1024 tokens: 21,719,678,976 FLOPs.
STEP_FLOPS = 21_719_678_976
RATES = Rates(flops=1e12, intra_bytes=100e9, inter_bytes=10e9, ppn=4)


def work(samples: int = 16, **changes) -> Workload:
    return Workload(seq_len=64, micro_batch_size=1, global_batch_samples=samples, **changes)


def test_compute_is_the_steps_flops_over_the_world_and_the_rate():
    one = step_cost(MODEL, Layout(dp_replicate=4), work(), RATES)
    assert one.compute == pytest.approx(STEP_FLOPS / 4 / 1e12)
    # Every layout of the same world computes the same FLOPs.
    for layout in (Layout(dp_shard=4), Layout(tp=2, dp_shard=2), Layout(pp=2, dp_shard=2)):
        assert step_cost(MODEL, layout, work(), RATES).compute == one.compute


def test_recompute_is_a_third_of_the_blocks_flops():
    # Blocks: 21,210,624 - 6 x (256,000 + 256) = 19,673,088 FLOPs a token, a third recomputed:
    # x 1024 tokens / 4 devices / 1e12.
    cost = step_cost(MODEL, Layout(dp_shard=4, activation_checkpointing="full"), work(), RATES)
    assert cost.recompute == pytest.approx(19_673_088 / 3 * 1024 / 4 / 1e12)
    assert 1.25 < (cost.compute + cost.recompute) / cost.compute < 4 / 3
    assert step_cost(MODEL, Layout(dp_shard=4), work(), RATES).recompute == 0


@pytest.mark.parametrize(("pp", "samples"), [(2, 16), (2, 2), (4, 8)])
def test_the_bubble_is_p_minus_1_over_m_plus_p_minus_1_of_the_pipelines_time(pp, samples):
    layout = Layout(pp=pp, dp_replicate=4 // pp)
    cost = step_cost(MODEL, layout, work(samples), RATES)
    micro = samples // layout.dp  # micro-batches per pipeline and step
    busy = cost.compute + cost.recompute
    assert cost.bubble / (busy + cost.bubble) == pytest.approx((pp - 1) / (micro + pp - 1))


def test_fsdp_gathers_twice_a_micro_batch_and_reduces_once_a_step():
    # FSDP over 4 ranks of one host, fp32-master (bf16 gathers, fp32 reduce-scatter), 4
    # micro-batches each: 8 gathers x 2 bytes + 1 x 4 bytes = 20 bytes a parameter, each rank
    # sending 3/4 of it: 20 x 3,660,032 x 3/4 = 54,900,480 bytes at 100 GB/s.
    cost = step_cost(MODEL, Layout(dp_shard=4), work(), RATES)
    assert cost.fsdp == pytest.approx(54_900_480 / 100e9)
    synced = step_cost(MODEL, Layout(dp_shard=4), work(sync_every_micro_batch=True), RATES)
    assert synced.fsdp == pytest.approx((8 * 2 + 4 * 4) * TOTAL * 3 / 4 / 100e9)
    # Hidden behind the compute (0.0054 s) it costs nothing; on a slow link it shows.
    assert cost.fsdp < cost.compute and cost.fsdp_exposed == 0 and cost.comm == 0
    slow = Rates(flops=1e12, intra_bytes=1e8, inter_bytes=1e8, ppn=4)
    slow_cost = step_cost(MODEL, Layout(dp_shard=4), work(), slow)
    assert slow_cost.fsdp_exposed == pytest.approx(slow_cost.fsdp - slow_cost.compute)
    assert slow_cost.total == pytest.approx(slow_cost.compute + slow_cost.fsdp_exposed)


def test_under_pp_fsdp_gathers_and_reduces_once_a_step():
    # pp 2 over 2 hosts of 2: stage 0 holds 2 blocks + the embedding (1,829,888), stage 1 two
    # blocks, the head and the final norm (1,830,144, the larger); FSDP over the 2 ranks of a
    # stage's host: (2 + 4) bytes x 1,830,144 x 1/2.
    rates = Rates(flops=1e12, intra_bytes=100e9, inter_bytes=10e9, ppn=2)
    cost = step_cost(MODEL, Layout(pp=2, dp_shard=2), work(), rates)
    assert cost.fsdp == pytest.approx(6 * 1_830_144 / 2 / 100e9)
    # Activations to the next stage and gradients back: 2 x 64 tokens x 256 x 2 bytes a
    # micro-batch, 8 micro-batches, across hosts.
    assert cost.pp == pytest.approx(2 * 64 * 256 * 2 * 8 / 10e9)


def test_tp_moves_the_activations_eight_times_a_block_and_four_more_when_recomputed():
    # tp 2 x dp_shard 2, 16 samples on 2 data-parallel ranks: 8 micro-batches of 64 tokens;
    # each collective moves half of 64 x 256 x 2 bytes = 16,384 bytes; 4 blocks x 8 + 4 = 36
    # collectives a micro-batch.
    cost = step_cost(MODEL, Layout(tp=2, dp_shard=2), work(), RATES)
    assert cost.tp == pytest.approx(36 * 16_384 * 8 / 100e9)
    recomputed = step_cost(
        MODEL, Layout(tp=2, dp_shard=2, activation_checkpointing="full"), work(), RATES
    )
    assert recomputed.tp == pytest.approx(52 * 16_384 * 8 / 100e9)


def test_cp_passes_k_and_v_round_the_ring():
    # cp 2 x dp_shard 2: 32 tokens a rank; K and V 2 x 128 x 2 bytes a token; 3 passes (forward,
    # and K, V with their gradients backward) x (cp - 1) x 4 layers x 8 micro-batches (16
    # samples on 2 data-parallel ranks).
    cost = step_cost(MODEL, Layout(cp=2, dp_shard=2), work(), RATES)
    assert cost.cp == pytest.approx(3 * 1 * 32 * 512 * 4 * 8 / 100e9)


def test_groups_cross_hosts_by_the_mesh_order():
    layout = Layout(dp_replicate=2, dp_shard=4, tp=2)  # 16 ranks, tp fastest
    assert not spans_hosts(layout, "tp", 8) and not spans_hosts(layout, "fsdp", 8)
    assert spans_hosts(layout, "dp_replicate", 8)
    assert spans_hosts(layout, "fsdp", 4) and not spans_hosts(layout, "tp", 4)
    assert spans_hosts(Layout(tp=3), "tp", 4)  # 3 does not divide a host's 4 ranks
    assert spans_hosts(Layout(pp=2, dp_shard=4), "pp", 4)
    # The same FSDP group costs more across hosts.
    rates = Rates(flops=1e12, intra_bytes=100e9, inter_bytes=10e9, ppn=2)
    across = step_cost(MODEL, Layout(dp_shard=4), work(), rates)
    within = step_cost(MODEL, Layout(dp_shard=4), work(), RATES)
    assert across.fsdp == pytest.approx(10 * within.fsdp)
