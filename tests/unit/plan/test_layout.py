"""The ladder on the seed's machines, with the arithmetic done by hand in the comments: a 20B
and an 80B shape on Aurora-like nodes (12 devices of 64 GiB), a 405B shape on 8 x 80 GiB nodes,
a tiny model, a batch too small for the data-parallel degree, a mixture of experts; the
critical batch and the TP-across-hosts warnings; and the planner's idea of what goodput accepts
against the trainer's own checks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from goodput.config import load_section
from goodput.plan.batch import critical_batch_tokens, critical_batch_warning
from goodput.plan.ladder import RUNGS, Machine, plan_layout
from goodput.plan.layout import Layout, problems, tp_across_hosts
from goodput.plan.memory import Workload
from goodput.testing.jobs import REPO
from goodput.train.model_config import ModelConfig, MoEConfig

AURORA = {"gpus_per_node": 12, "gpu_mem_gib": 64.0}
H100 = {"gpus_per_node": 8, "gpu_mem_gib": 80.0}


def shipped(name: str) -> ModelConfig:
    return load_section(ModelConfig, REPO / "configs" / f"{name}.toml", "model")


def work(seq_len: int, samples: int, **changes) -> Workload:
    return Workload(seq_len=seq_len, micro_batch_size=1, global_batch_samples=samples, **changes)


def lines(plan) -> list[tuple[str, str | None, str | None]]:
    return [(a.rung, a.layout and a.layout.describe(), a.reason) for a in plan.attempts]


def assert_in_ladder_order(plan):
    order = [RUNGS.index(a.rung) for a in plan.attempts]
    assert order == sorted(order)
    assert all(a.reason for a in plan.rejected)
    assert plan.attempts[-1] is plan.chosen


# llama-20b: V = 128256, d = 6144, 44 layers, 48 heads, 8 kv heads (kv = 8 x 128 = 1024), e = 128,
# f = 16384. Per block: attention d e (2h + 2k) = 6144 x 128 x 112 = 88,080,384; MLP 3 d f =
# 301,989,888; norms 2d = 12,288; block = 390,082,560. Embedding = head = V d = 788,004,864, final
# norm 6144. Total = 44 x 390,082,560 + 2 x 788,004,864 + 6144 = 18,739,648,512.
# Global batch 384 x 4096 = 1,572,864 tokens; world 8 x 12 = 96, so 4 micro-batches a rank.
# Activations, bf16 (a = 2), per token and layer: norms 2 (4d + 4 + a d) = 12d + 8 = 73,736;
# attention a (2d + 2kv) + 4h = 24,576 + 4,096 + 192 = 28,864; MLP 4 a f = 131,072; gathered norm
# outputs 2 a d = 24,576 and cos/sin 4e = 512: 258,760 bytes. x 4096 tokens x 44 layers =
# 46,634,762,240. Logits: 4096 x (V (2 + 4) + (4d + 4 + 2d) + 2d) = 4096 x 818,692 =
# 3,353,362,432. Gathered (bf16): 2 x (2 blocks + embedding + head + final norm) =
# 2 x (780,165,120 + 1,576,015,872) = 4,712,361,984. Runtime: 10% of 64 GiB = 6,871,947,673.6.
ACT_20B, LOGITS_20B, GATHERED_20B = 46_634_762_240, 3_353_362_432, 4_712_361_984


def test_20b_on_8_aurora_nodes_shards_over_4_nodes():
    plan = plan_layout(shipped("llama-20b"), Machine(nodes=8, **AURORA), work(4096, 384))
    assert_in_ladder_order(plan)
    assert [(rung, layout) for rung, layout, _ in lines(plan)] == [
        ("DP", "dp_replicate 96"),
        ("FSDP", "dp_replicate 8 x dp_shard 12"),
        ("FSDP", "dp_replicate 4 x dp_shard 24"),
        ("FSDP", "dp_replicate 2 x dp_shard 48"),
    ]
    # DP: state 16 x 18,739,648,512 = 299,834,376,192 (unsharded, so no held gradients) + the
    # rest = 361,406,810,521.6 bytes = 336.6 GiB.
    dp = plan.attempts[0].breakdown
    assert dp.total == pytest.approx(361_406_810_521.6)
    assert plan.attempts[0].reason == "336.6 GiB per device > 64.0 GiB"
    # FSDP over 24, gradients reduced every micro-batch: state 16 x total / 24 =
    # 12,493,099,008, + the rest = 74,065,533,337.6 bytes = 69.0 GiB.
    assert plan.attempts[2].breakdown.total == pytest.approx(74_065_533_337.6)
    assert plan.attempts[2].reason.startswith("69.0 GiB per device (reducing gradients every")
    # Chosen, FSDP over 48: state 16 x total / 48 = 6,246,549,504. Total 67,818,983,833.6 bytes
    # = 63.16 GiB, which fits only with the gradients reduced every micro-batch: held, they
    # would add 4 x total x 47/48 = 73,397,956,672.
    chosen = plan.chosen.breakdown
    assert chosen.state == pytest.approx(6_246_549_504)
    assert chosen.gathered == pytest.approx(GATHERED_20B)
    assert chosen.activations == pytest.approx(ACT_20B)
    assert chosen.logits == pytest.approx(LOGITS_20B)
    assert chosen.held_gradients == 0 and plan.chosen.sync_every_micro_batch
    assert chosen.total == pytest.approx(67_818_983_833.6)
    assert plan.chosen.layout == Layout(dp_replicate=2, dp_shard=48)
    held = plan_layout(shipped("llama-20b"), Machine(nodes=8, **AURORA), work(4096, 96))
    assert held.chosen.breakdown.held_gradients == 0  # one micro-batch a rank: nothing held
    assert plan.warnings == ()


def test_20b_on_2_and_32_aurora_nodes():
    model = shipped("llama-20b")
    two = plan_layout(model, Machine(nodes=2, **AURORA), work(4096, 384))
    # 24 devices, 16 micro-batches a rank: FSDP over 12 (80.6 GiB) and over 24 (69.0 GiB) do not
    # fit; tp 2 within a node with FSDP over the node's 6 TP groups does (57.3 GiB).
    assert [a.rung for a in two.attempts] == ["DP", "FSDP", "FSDP", "TP"]
    assert two.chosen.layout == Layout(tp=2, dp_replicate=2, dp_shard=6)
    assert_in_ladder_order(two)
    wide = plan_layout(model, Machine(nodes=32, **AURORA), work(4096, 384))
    # 384 devices, one micro-batch each: nothing is held, and FSDP over 4 nodes fits.
    assert wide.chosen.layout == Layout(dp_replicate=8, dp_shard=48)
    assert not wide.chosen.sync_every_micro_batch


# llama-80b: V = 128256, d = 9216, 88 layers, 72 heads, 8 kv heads, e = 128, f = 24576. Per block:
# attention 9216 x 128 x 160 = 188,743,680; MLP 3 x 9216 x 24576 = 679,477,248; split by tp:
# 868,220,928; norms 18,432. Embedding = head = V d = 1,182,007,296.
def test_80b_on_8_aurora_nodes_needs_tp_4():
    plan = plan_layout(shipped("llama-80b"), Machine(nodes=8, **AURORA), work(4096, 384))
    assert_in_ladder_order(plan)
    assert [a.rung for a in plan.attempts] == ["DP"] + ["FSDP"] * 4 + ["TP"] * 9
    invalid = next(a for a in plan.attempts if a.layout and a.layout.tp == 3)
    assert invalid.breakdown is None and "does not divide model.num_kv_heads = 8" in invalid.reason
    assert plan.chosen.layout == Layout(tp=4, dp_shard=24)
    # tp 4 x FSDP 24. Per device, unsharded: 88 x (868,220,928 / 4 + 18,432) + 2 x
    # 1,182,007,296 / 4 + 9216 = 19,693,495,296; state 16 x that / 24 = 13,128,996,864.
    # Gathered: 2 x (2 x 217,073,664 + 591,003,648 + 9216) = 2,050,320,384.
    # Activations per token and layer: split (12d + 8) + (4d + 4kv + 4h) + 8f = 110,600 + 41,248
    # + 196,608 = 348,456, / 4 = 87,114, + whole 2 a d + 4e = 37,376: 124,490; x 4096 x 88 =
    # 44,872,171,520. Logits: 4096 x (V x 6 / 4 + 55,300 / 4 + 18,432) = 4096 x 224,641 =
    # 920,129,536. Total with the runtime allowance: 67,843,565,977.6 bytes = 63.18 GiB.
    chosen = plan.chosen.breakdown
    assert chosen.state == pytest.approx(13_128_996_864)
    assert chosen.gathered == pytest.approx(2_050_320_384)
    assert chosen.activations == pytest.approx(44_872_171_520)
    assert chosen.logits == pytest.approx(920_129_536)
    assert chosen.total == pytest.approx(67_843_565_977.6)


def test_80b_on_2_aurora_nodes_fits_nowhere_and_says_the_smallest():
    plan = plan_layout(shipped("llama-80b"), Machine(nodes=2, **AURORA), work(4096, 384))
    assert plan.chosen is None
    rungs = [a.rung for a in plan.attempts]
    assert rungs.index("PP") < rungs.index("CP") and rungs[-1] == "CP"
    what, fix = plan.failure()
    assert what.startswith("no layout fits: the smallest estimate is 78.5 GiB per device (CP ")
    assert "more nodes" in fix and "--activation-checkpointing" in fix
    # Under FSDP, PP 2 halves the layers and the shard degree alike, and 1F1B keeps 2
    # micro-batches in flight on the first stage: no relief against TP 4 x FSDP 6.
    pp = next(a for a in plan.attempts if a.rung == "PP")
    tp4 = next(a for a in plan.attempts if a.layout == Layout(tp=4, dp_shard=6))
    assert pp.breakdown.total > tp4.breakdown.total


def test_80b_on_32_aurora_nodes():
    plan = plan_layout(shipped("llama-80b"), Machine(nodes=32, **AURORA), work(4096, 384))
    assert plan.chosen.layout == Layout(tp=4, dp_shard=24, dp_replicate=4)


# llama-405b: V = 128256, d = 16384, 126 layers, 128 heads, 8 kv heads, e = 128, f = 53248. Per
# block: attention 16384 x 128 x 272 = 570,425,344; MLP 3 x 16384 x 53248 = 2,617,245,696; split
# 3,187,671,040; norms 32,768. Embedding = head = 2,101,346,304.
def test_405b_on_64_h100_nodes_with_activation_checkpointing():
    plan = plan_layout(
        shipped("llama-405b"),
        Machine(nodes=64, **H100),
        work(8192, 512, activation_checkpointing=True),
    )
    assert_in_ladder_order(plan)
    assert plan.chosen.layout == Layout(tp=2, dp_shard=128, dp_replicate=2)
    # tp 2: unsharded per device 126 x (1,593,835,520 + 32,768) + 2,101,346,304 + 16384 =
    # 202,928,766,976; state 16 x that / 128 = 25,366,095,872. Gathered: 2 x (2 x 1,593,868,288
    # + 2,101,362,688) = 10,578,198,528. Checkpointed activations, per token: 126 layer inputs
    # a d / tp = 126 x 16,384 + one layer's (692,744 / 2 + 2 a d + 4e = 412,420) = 2,476,804;
    # x 8192 = 20,289,978,368. Logits: 8192 x (V x 6 / 2 + 98,308 / 2 + 32,768) = 8192 x
    # 466,690 = 3,823,124,480. Runtime 8 GiB. Total 68,647,331,840 bytes = 63.93 GiB.
    chosen = plan.chosen.breakdown
    assert chosen.state == pytest.approx(25_366_095_872)
    assert chosen.gathered == pytest.approx(10_578_198_528)
    assert chosen.activations == pytest.approx(20_289_978_368)
    assert chosen.logits == pytest.approx(3_823_124_480)
    assert chosen.total == pytest.approx(68_647_331_840)
    # 2 micro-batches a rank: the unsharded gradients would not fit beside it.
    assert plan.chosen.sync_every_micro_batch


def test_405b_without_checkpointing_climbs_to_cp():
    plan = plan_layout(shipped("llama-405b"), Machine(nodes=64, **H100), work(8192, 512))
    assert plan.chosen.rung == "CP"
    assert plan.chosen.layout == Layout(tp=8, dp_shard=16, cp=4)
    assert_in_ladder_order(plan)


def test_pp_comes_when_data_parallelism_runs_out():
    # 405B on 256 nodes (2048 devices) with 128 samples a step: tp 8 leaves 256 data-parallel
    # ranks, more than the batch has samples; pp 2 halves them.
    plan = plan_layout(
        shipped("llama-405b"),
        Machine(nodes=256, **H100),
        work(8192, 128, activation_checkpointing=True),
    )
    assert plan.chosen.rung == "PP" and plan.chosen.layout.pp == 2
    assert plan.chosen.layout.dp == 128
    batch = [a for a in plan.rejected if a.reason and "does not split" in a.reason]
    assert batch and all("data parallelism runs out before memory" in a.reason for a in batch)


def test_a_tiny_model_picks_dp():
    machine = Machine(nodes=1, gpus_per_node=4, gpu_mem_gib=16)
    plan = plan_layout(shipped("tiny-cpu"), machine, work(128, 32))
    assert plan.chosen.rung == "DP" and plan.rejected == ()
    assert plan.chosen.layout == Layout(dp_replicate=4)


def test_a_batch_too_small_for_the_dp_degree_is_rejected_with_the_reason():
    # 12 samples of 128 tokens on 16 ranks: every layout with 16 data-parallel ranks is refused
    # for the batch, though it fits in memory; tp 2 (of 2, 4 and 8 the only one dividing the 2
    # kv heads) leaves 8 ranks, still not dividing 12; pp 2 x tp 2 leaves 4, which do.
    tiny = shipped("tiny-cpu")
    plan = plan_layout(tiny, Machine(nodes=2, gpus_per_node=8, gpu_mem_gib=16), work(128, 12))
    dp = plan.attempts[0]
    assert dp.reason.startswith("fits in 1.6 GiB per device, but the global batch of 12 samples ")
    assert "does not split into micro-batches of 1 on 16 data-parallel ranks" in dp.reason
    assert "critical batch" in dp.reason
    assert [a.rung for a in plan.attempts] == ["DP"] + ["FSDP"] * 2 + ["TP"] * 4 + ["PP"]
    assert plan.chosen.layout == Layout(pp=2, tp=2, dp_shard=4)
    assert_in_ladder_order(plan)
    # A mixture of experts has no tp, pp or cp to lower its 8 data-parallel ranks: 7 samples
    # split nowhere.
    hopeless = plan_layout(
        shipped("moe-small"), Machine(nodes=1, gpus_per_node=8, gpu_mem_gib=16), work(256, 7)
    )
    assert hopeless.chosen is None
    assert hopeless.failure()[0].startswith("no layout splits the global batch of 7 samples")


# Kaplan et al. for llama-20b: N = 44 x 390,082,560 + 6144 = 17,163,638,784 non-embedding
# parameters; L = (8.8e13 / N)^0.076 = 5127.1^0.076 = e^(0.076 x 8.5424) = e^0.64922 = 1.9140;
# B_crit = 2e8 / L^(1/0.21) = 2e8 / e^(0.64922 / 0.21) = 2e8 / e^3.0915 = 2e8 / 22.010 = 9.087e6.
def test_the_critical_batch_warning_fires_above_kaplans_estimate():
    model = shipped("llama-20b")
    assert critical_batch_tokens(17_163_638_784) == pytest.approx(9.087e6, rel=1e-3)
    assert critical_batch_warning(model, 1_572_864) is None
    warning = critical_batch_warning(model, 4096 * 4096)
    assert warning.startswith("the global batch of 16,777,216 tokens exceeds the critical batch ")
    assert "~9.1M tokens for 17.2B non-embedding parameters (Kaplan et al. 2020" in warning
    assert "order-of-magnitude" in warning and "gradient noise scale" in warning
    plan = plan_layout(model, Machine(nodes=32, **AURORA), work(4096, 4096))
    assert plan.warnings == (warning,)


def test_tp_across_hosts_is_a_warning():
    assert tp_across_hosts(Layout(tp=4, dp_shard=6), nodes=2, gpus_per_node=12) is None
    assert tp_across_hosts(Layout(tp=5), nodes=1, gpus_per_node=12) is None  # one host
    for tp in (8, 16, 24):
        warning = tp_across_hosts(Layout(tp=tp), nodes=2, gpus_per_node=12)
        assert warning.startswith(f"tp = {tp} does not divide the 12 ranks per host")
        assert "span hosts" in warning
    plan = plan_layout(
        shipped("llama-20b"), Machine(nodes=8, **AURORA), work(4096, 384), given=Layout(tp=16)
    )
    assert plan.warnings[0].startswith("the config's [parallel]: tp = 16 does not divide the 12")


# A 22.8B mixture of experts (1.7B active): per block 64 experts x 3 x 4096 x 1536 =
# 1,207,959,552 of its 1,250,172,928 parameters. On one node of 8 x 64 GiB, FSDP gathers two
# blocks' experts in bf16, 2 x 2 x 1,207,959,552 = 4.83e9 bytes; with ep 2 each rank gathers
# half of them.
MOE = ModelConfig(
    vocab_size=32000,
    dim=4096,
    num_layers=18,
    num_heads=32,
    num_kv_heads=8,
    max_seq_len=4096,
    moe=MoEConfig(num_experts=64, top_k=2, expert_ffn_dim=1536),
)


def test_a_moe_model_gets_ep_and_skips_tp_pp_and_cp():
    plan = plan_layout(MOE, Machine(nodes=1, gpus_per_node=8, gpu_mem_gib=64), work(4096, 8))
    assert [(rung, layout) for rung, layout, _ in lines(plan)] == [
        ("DP", "dp_replicate 8"),
        ("FSDP", "dp_shard 8"),
        ("EP", "dp_shard 8 (ep 2 within dp_shard)"),
    ]
    fsdp, ep = plan.attempts[1].breakdown, plan.chosen.breakdown
    # The experts' state shards the same (16 x 1,207,959,552 x 18 / 8 either way); the
    # gathered experts halve: 2 blocks x 1,207,959,552 / 2 x 2 bytes fewer.
    assert ep.state == fsdp.state
    assert fsdp.gathered - ep.gathered == pytest.approx(2 * 1_207_959_552 // 2 * 2)
    assert plan.chosen.layout.overrides().endswith("parallel.ep=2")
    short = plan_layout(MOE, Machine(nodes=1, gpus_per_node=8, gpu_mem_gib=48), work(4096, 8))
    assert short.chosen is None
    skipped = {a.rung: a.reason for a in short.attempts if a.layout is None}
    assert skipped == {
        rung: f"skipped: goodput refuses {rung.lower()} > 1 with a mixture-of-experts model today"
        for rung in ("TP", "PP", "CP")
    }


def test_ep_is_skipped_when_the_experts_are_few():
    # 18 x 2 experts x 3 x 4096 x 64 = 28,311,552 routed-expert parameters of 1,045,729,280.
    few = replace(MOE, moe=MoEConfig(num_experts=2, top_k=1, expert_ffn_dim=64))
    plan = plan_layout(few, Machine(nodes=1, gpus_per_node=8, gpu_mem_gib=1), work(4096, 8))
    ep = next(a for a in plan.attempts if a.rung == "EP")
    assert ep.layout is None and ep.reason.startswith("skipped: the routed experts are 3% of")


def test_a_layout_the_trainer_refuses_is_rejected_with_the_trainers_reason():
    model = shipped("tiny-cpu")  # 4 heads, 2 kv heads, 4 layers
    assert problems(model, Layout(tp=2, dp_shard=2), 128) == []
    assert problems(model, Layout(tp=4), 128) == ["tp = 4 does not divide model.num_kv_heads = 2"]
    assert problems(model, Layout(cp=2, pp=2), 128)[0].startswith("cp = 2 with pp = 2")
    assert problems(model, Layout(ep=2, dp_shard=2), 128)[0].startswith("ep = 2 needs a mixture")
    moe = shipped("moe-small")  # 8 experts
    assert problems(moe, Layout(ep=4, dp_shard=2), 128)[0].startswith(
        "ep = 4 does not divide dp_shard = 2"
    )
