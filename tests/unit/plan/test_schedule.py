"""The pipeline schedules as the planner prices them (``goodput.plan.schedule``): the bubble
against each paper's claim, the activations in flight against torch's warm-up counts, the
stages a rank holds; and MoE under tp as the planner lays it out (replicated over tp)."""

from __future__ import annotations

import pytest

from goodput.plan.cost import Rates, step_cost
from goodput.plan.layout import Layout
from goodput.plan.memory import Parameters, Workload, stage_parameters
from goodput.plan.schedule import bubble, in_flight
from goodput.train.config.model import ModelConfig, MoEConfig
from goodput.train.config.parallel import rank_stages

THIRD = 1.0  # F = B = W: each paper's analysis


def idle(schedule: str, pp: int = 4, micro: int = 8, v: int = 2, b: float = THIRD) -> float:
    return bubble(schedule, pp, v, micro, forward=THIRD, backward_input=b, backward_weight=THIRD)


def test_each_bubble_is_its_papers():
    # 1F1B and GPipe: (p - 1) / m of the step's compute (3 thirds), i.e. (p - 1) / (m + p - 1)
    # of the time.
    assert idle("1f1b") == idle("gpipe") == pytest.approx(3 * 3 / 8)
    assert idle("1f1b") / (3 + idle("1f1b")) == pytest.approx(3 / (8 + 3))
    # Interleaving divides it by the stages per rank; ZB-H1 is a third of 1F1B's (Qi et al.).
    assert idle("interleaved_1f1b", v=2) == pytest.approx(idle("1f1b") / 2)
    assert idle("interleaved_zb", v=1) == pytest.approx(idle("1f1b") / 3)
    assert idle("interleaved_zb", v=2) == pytest.approx(idle("1f1b") / 6)
    # ZB-V: zero when F = B = W; what recompute adds to B shows, halved (chunks of half a rank).
    assert idle("zbv") == 0
    assert idle("zbv", b=1.5) == pytest.approx(3 / 8 * 0.5 / 2)
    # DualPipeV (DeepSeek-V3 Table 2): (PP/2 - 1)(F&B + B - 3W) on 2p chunks of half a rank.
    assert idle("dualpipev") == pytest.approx(3 / 8 * (1 + 2 - 1) / 2)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_activations_in_flight_are_torchs_warmups(pp):
    micro = 2 * pp
    assert [in_flight("1f1b", pp, 1, micro, r) for r in range(pp)] == list(range(pp, 0, -1))
    assert in_flight("gpipe", pp, 1, micro, 0) == micro
    # Interleaved 1F1B: p + (p - 1) / v on rank 0 (Narayanan et al.'s 1 + (p - 1) / (p v)).
    assert in_flight("interleaved_1f1b", pp, 2, micro, 0) == pytest.approx(pp + (pp - 1) / 2)
    # ZB1P: 1F1B's p on rank 0 (Qi et al.); V schedules balanced over the ranks.
    assert in_flight("interleaved_zb", pp, 2, micro, 0) == pp
    assert {in_flight("zbv", pp, 2, micro, r) for r in range(pp)} == {pp}
    assert {in_flight("dualpipev", pp, 2, micro, r) for r in range(pp)} == {pp + 0.5}
    # Never more than the micro-batches of a step.
    assert in_flight("1f1b", pp, 1, 1, 0) == 1 and in_flight("dualpipev", pp, 2, 1, 0) == 1


def test_a_v_schedule_puts_the_first_and_last_stage_on_rank_0():
    assert rank_stages("zbv", 4, 2, 0) == [0, 7] and rank_stages("dualpipev", 4, 2, 3) == [3, 4]
    assert rank_stages("interleaved_1f1b", 4, 2, 0) == [0, 4]
    assert rank_stages("1f1b", 4, 1, 2) == [2]


# 8 layers of d 256; 8 experts of ffn 128, top-2, a shared expert; vocabulary 1024, untied.
MOE = ModelConfig(
    vocab_size=1024,
    dim=256,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=128, shared_expert=True),
)
WORK = Workload(seq_len=64, micro_batch_size=1, global_batch_samples=16)
RATES = Rates(flops=1e12, intra_bytes=100e9, inter_bytes=10e9, ppn=8)


def test_under_a_v_schedule_rank_0_holds_the_embedding_and_the_head():
    layout = Layout(pp=2, dp_shard=4, pp_schedule="zbv")
    params = Parameters.of(MOE)
    first, second = (stage_parameters(MOE, layout, r) for r in range(2))
    assert first.root == params.embedding + params.head + params.final_norm
    assert second.root == 0 and first.experts == second.experts  # 2 + 2 layers each


def test_the_moe_layer_is_replicated_over_tp():
    params = Parameters.of(MOE)
    one, two = (stage_parameters(MOE, Layout(tp=tp), 0) for tp in (1, 2))
    # The routed experts, the router and the shared expert are whole on every tp rank;
    # attention is split.
    assert two.experts == one.experts
    assert two.block_dense == params.block_split / 2 + params.block_whole
    assert params.block_whole == 2 * 256 + 8 * 256 + 3 * 256 * 128
    # Each tp rank dispatches its own slice of the sequence: the all-to-all halves.
    ep = step_cost(MOE, Layout(dp_shard=4, ep=2), WORK, RATES).ep
    assert step_cost(MOE, Layout(dp_shard=2, tp=2, ep=2), WORK, RATES).ep == pytest.approx(
        ep / 2 * 2
    )  # half the tokens a rank, on twice the micro-batches (dp 2 instead of 4)


@pytest.mark.parametrize(
    ("dp_shard", "cp", "ep", "rows"), [(4, 2, 2, 1), (2, 1, 2, 4), (4, 1, 4, 2)]
)
def test_the_experts_shard_over_dp_shard_over_ep_times_cp(dp_shard, cp, ep, rows):
    layout = Layout(dp_shard=dp_shard, cp=cp, ep=ep)
    assert layout.expert_fsdp == dp_shard // ep * cp
    part = stage_parameters(MOE, layout, 0)
    dense = sum(
        count * -(-r // layout.shard) * width
        for count, r, width, expert in part.tensors
        if not expert
    )
    # 8 layers x 3 stacked weights of 8 / ep experts, ceil(8 / ep / expert_fsdp) a rank.
    assert part.sharded(layout) - dense == 8 * 3 * rows * 256 * 128
