"""The ladder on the seed's machines, with the arithmetic done by hand in the comments: a 20B
and an 80B shape on Aurora-like nodes (12 devices of 64 GiB), a 405B shape on 8 x 80 GiB nodes,
a tiny model, a batch too small for the data-parallel degree, a mixture of experts; the
critical batch and the TP-across-hosts warnings; and the planner's idea of what goodput accepts
against the trainer's own checks."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from goodput.config import load_section
from goodput.errors import ExitCode, GoodputError
from goodput.plan.batch import critical_batch_tokens, critical_batch_warning
from goodput.plan.cost import Rates
from goodput.plan.ladder import (
    MAX_CANDIDATES,
    RUNGS,
    TIE,
    Machine,
    Options,
    evaluate,
    plan_layout,
    rung_of,
)
from goodput.plan.layout import Layout, problems, tp_across_hosts
from goodput.plan.memory import Workload
from goodput.testing.jobs import REPO
from goodput.train.config.model import ModelConfig, MoEConfig

AURORA = {"ppn": 12, "gpu_mem_gib": 64.0}
# FSDP gives each rank ceil(rows / shard) rows of every tensor: the figures below, written
# without that rounding, are within this share of the estimate's.
PADDING = 3e-3
H100 = {"ppn": 8, "gpu_mem_gib": 80.0}


def shipped(name: str) -> ModelConfig:
    return load_section(ModelConfig, REPO / "configs" / f"{name}.toml", "model")


def work(seq_len: int, samples: int, **changes) -> Workload:
    return Workload(seq_len=seq_len, micro_batch_size=1, global_batch_samples=samples, **changes)


def rates(ppn: int) -> Rates:
    return Rates(flops=400e12, intra_bytes=300e9, inter_bytes=25e9, ppn=ppn)


def plan(model: ModelConfig, machine: Machine, workload: Workload, **options):
    return plan_layout(model, machine, workload, rates(machine.ppn), **options)


def check(model: ModelConfig, machine: Machine, workload: Workload, layout: Layout):
    """One layout evaluated as the planner evaluates its candidates."""
    return evaluate(model, machine, workload, rates(machine.ppn), layout, rung_of(layout))


def assert_a_sound_choice(result):
    """Candidates in order of pain, each labelled with its rung; the chosen one fits and is the
    cheapest of the least painful rung within TIE of the cheapest."""
    order = [RUNGS.index(c.rung) for c in result.candidates]
    assert order == sorted(order)
    assert all(c.rung == rung_of(c.layout) for c in result.candidates if c.layout)
    chosen, fitting = result.chosen, result.fitting
    assert chosen.fits and chosen in fitting
    best = fitting[0].cost.total
    assert chosen.cost.total <= best * (1 + TIE)
    cheaper_rungs = {c.rung for c in fitting if c.cost.total <= best * (1 + TIE)}
    assert RUNGS.index(chosen.rung) == min(RUNGS.index(rung) for rung in cheaper_rungs)


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


def test_20b_memory_term_by_term():
    model, machine = shipped("llama-20b"), Machine(nhosts=8, **AURORA)
    # DP: state 16 x 18,739,648,512 = 299,834,376,192 (unsharded, so no held gradients) + the
    # rest = 361,406,810,521.6 bytes = 336.6 GiB.
    dp = check(model, machine, work(4096, 384), Layout(dp_replicate=96))
    assert dp.breakdown.total == pytest.approx(361_406_810_521.6, rel=PADDING)
    assert dp.reason == "336.6 GiB per device > 64.0 GiB"
    # FSDP over 24, gradients reduced every micro-batch: state 16 x total / 24 =
    # 12,493,099,008, + the rest = 74,065,533,337.6 bytes = 69.0 GiB.
    fsdp24 = check(model, machine, work(4096, 384), Layout(dp_replicate=4, dp_shard=24))
    assert fsdp24.breakdown.total == pytest.approx(74_065_533_337.6, rel=PADDING)
    assert fsdp24.reason.startswith("69.0 GiB per device (reducing gradients every")
    # FSDP over 48: state 16 x total / 48 = 6,246,549,504. Total 67,818,983,833.6 bytes =
    # 63.16 GiB, which fits only with the gradients reduced every micro-batch: held, they would
    # add 4 x total x 47/48 = 73,397,956,672.
    fsdp48 = check(model, machine, work(4096, 384), Layout(dp_replicate=2, dp_shard=48))
    chosen = fsdp48.breakdown
    assert chosen.state == pytest.approx(6_246_549_504, rel=PADDING)
    assert chosen.gathered == pytest.approx(GATHERED_20B)
    assert chosen.activations == pytest.approx(ACT_20B)
    assert chosen.logits == pytest.approx(LOGITS_20B)
    assert chosen.held_gradients == 0 and fsdp48.sync_every_micro_batch and fsdp48.fits
    assert chosen.total == pytest.approx(67_818_983_833.6, rel=PADDING)
    once = check(model, machine, work(4096, 96), Layout(dp_replicate=2, dp_shard=48))
    assert once.breakdown.held_gradients == 0  # one micro-batch a rank: nothing held


def test_20b_on_8_aurora_nodes_takes_the_cheapest_that_fits():
    result = plan(shipped("llama-20b"), Machine(nhosts=8, **AURORA), work(4096, 384))
    assert_a_sound_choice(result)
    # FSDP over 48 fits (above) but gathers a 20B model's weights over the network for every
    # micro-batch; tp 2 within a host halves what FSDP moves, and its own traffic stays on the
    # host.
    fsdp48 = next(c for c in result.candidates if c.layout == Layout(dp_replicate=2, dp_shard=48))
    assert fsdp48.fits and result.chosen.cost.total < fsdp48.cost.total
    # With the per-op checkpointing rung, FSDP within a host fits at a tenth of a forward's
    # recompute: cheaper than tp 2.
    chosen = result.chosen.layout
    assert (chosen.tp > 1 or chosen.activation_checkpointing == "op") and result.warnings == ()


# llama-80b: V = 128256, d = 9216, 88 layers, 72 heads, 8 kv heads, e = 128, f = 24576. Per block:
# attention 9216 x 128 x 160 = 188,743,680; MLP 3 x 9216 x 24576 = 679,477,248; split by tp:
# 868,220,928; norms 18,432. Embedding = head = V d = 1,182,007,296.
def test_80b_at_tp_4_memory_term_by_term():
    layout = Layout(tp=4, dp_shard=24)
    candidate = check(shipped("llama-80b"), Machine(nhosts=8, **AURORA), work(4096, 384), layout)
    # tp 4 x FSDP 24. Per device, unsharded: 88 x (868,220,928 / 4 + 18,432) + 2 x
    # 1,182,007,296 / 4 + 9216 = 19,693,495,296; state 16 x that / 24 = 13,128,996,864.
    # Gathered: 2 x (2 x 217,073,664 + 591,003,648 + 9216) = 2,050,320,384.
    # Activations per token and layer: split (12d + 8) + (4d + 4kv + 4h) + 8f = 110,600 + 41,248
    # + 196,608 = 348,456, / 4 = 87,114, + whole 2 a d + 4e = 37,376: 124,490; x 4096 x 88 =
    # 44,872,171,520. Logits: 4096 x (V x 6 / 4 + 55,300 / 4 + 18,432) = 4096 x 224,641 =
    # 920,129,536. Total with the runtime allowance: 67,843,565,977.6 bytes = 63.18 GiB.
    chosen = candidate.breakdown
    assert chosen.state == pytest.approx(13_128_996_864, rel=PADDING)
    assert chosen.gathered == pytest.approx(2_050_320_384)
    assert chosen.activations == pytest.approx(44_872_171_520)
    assert chosen.logits == pytest.approx(920_129_536)
    assert chosen.total == pytest.approx(67_843_565_977.6, rel=PADDING)
    machine = Machine(nhosts=8, **AURORA)
    invalid = check(shipped("llama-80b"), machine, work(4096, 384), Layout(tp=3, dp_shard=32))
    assert invalid.breakdown is None and "does not divide model.num_kv_heads = 8" in invalid.reason


def test_80b_on_2_aurora_nodes_fits_only_with_checkpointing():
    model, machine = shipped("llama-80b"), Machine(nhosts=2, **AURORA)
    without = plan(model, machine, work(4096, 384), options=Options(checkpointing=("none",)))
    assert without.chosen is None
    what, fix = without.failure()
    assert what.startswith("no layout fits: the smallest estimate is 68.5 GiB per device (CP ")
    assert "more hosts" in fix and "allow activation checkpointing" in fix
    assert all(
        c.layout is None or c.layout.activation_checkpointing == "none" for c in without.candidates
    )
    # Under FSDP, PP 2 halves the layers and the shard degree alike, and 1F1B keeps 2
    # micro-batches in flight on the first stage: no relief against TP 4 x FSDP 6.
    pp = next(c for c in without.candidates if c.rung == "PP" and c.layout.tp == 4)
    tp4 = next(c for c in without.candidates if c.layout == Layout(tp=4, dp_shard=6))
    assert pp.breakdown.total > tp4.breakdown.total
    result = plan(model, machine, work(4096, 384))
    assert_a_sound_choice(result)
    assert result.chosen.layout.activation_checkpointing != "none"
    forced = plan(model, machine, work(4096, 384), options=Options(checkpointing=("full",)))
    assert all(
        c.layout.activation_checkpointing == "full" for c in forced.candidates if c.breakdown
    )


# llama-405b: V = 128256, d = 16384, 126 layers, 128 heads, 8 kv heads, e = 128, f = 53248. Per
# block: attention 16384 x 128 x 272 = 570,425,344; MLP 3 x 16384 x 53248 = 2,617,245,696; split
# 3,187,671,040; norms 32,768. Embedding = head = 2,101,346,304.
def test_405b_at_tp_2_with_checkpointing_memory_term_by_term():
    layout = Layout(tp=2, dp_shard=128, dp_replicate=2, activation_checkpointing="full")
    candidate = check(shipped("llama-405b"), Machine(nhosts=64, **H100), work(8192, 512), layout)
    # tp 2: unsharded per device 126 x (1,593,835,520 + 32,768) + 2,101,346,304 + 16384 =
    # 202,928,766,976; state 16 x that / 128 = 25,366,095,872. Gathered: 2 x (2 x 1,593,868,288
    # + 2,101,362,688) = 10,578,198,528. Checkpointed activations, per token: 126 layer inputs
    # a d / tp = 126 x 16,384 + one layer's (692,744 / 2 + 2 a d + 4e = 412,420) = 2,476,804;
    # x 8192 = 20,289,978,368. Logits: 8192 x (V x 6 / 2 + 98,308 / 2 + 32,768) = 8192 x
    # 466,690 = 3,823,124,480. Runtime 8 GiB. Total 68,647,331,840 bytes = 63.93 GiB.
    chosen = candidate.breakdown
    assert chosen.state == pytest.approx(25_366_095_872, rel=PADDING)
    assert chosen.gathered == pytest.approx(10_578_198_528)
    assert chosen.activations == pytest.approx(20_289_978_368)
    assert chosen.logits == pytest.approx(3_823_124_480)
    assert chosen.total == pytest.approx(68_647_331_840, rel=PADDING)
    # 2 micro-batches a rank: the unsharded gradients would not fit beside it.
    assert candidate.sync_every_micro_batch


def test_the_405b_config_plans_at_8192_not_its_max_seq_len():
    # llama-405b.toml has max_seq_len 131,072 (its long-context RoPE); at seq 8192 on 64 nodes
    # the planner needs no cp, where at 131,072 tokens a sequence it would.
    model = shipped("llama-405b")
    result = plan(model, Machine(nhosts=64, **H100), work(8192, 512))
    assert_a_sound_choice(result)
    assert result.chosen.layout.cp == 1


def test_pp_comes_when_data_parallelism_runs_out():
    # 405B on 256 nodes (2048 devices) with 128 samples a step: tp 8 leaves 256 data-parallel
    # ranks, more than the batch has samples; pp halves them at least.
    result = plan(
        shipped("llama-405b"),
        Machine(nhosts=256, **H100),
        work(8192, 128),
        options=Options(checkpointing=("full",)),
    )
    assert result.chosen.rung in ("PP", "CP") and result.chosen.layout.dp <= 128
    batch = [c for c in result.candidates if c.reason and "does not split" in c.reason]
    assert batch and all("data parallelism runs out before memory" in c.reason for c in batch)
    assert_a_sound_choice(result)


def test_uneven_pipeline_stages_go_to_the_overrides():
    # 88 layers on 16 stages: 5 on the first and the last.
    layout = Layout(pp=16, tp=4, dp_shard=12, pp_layers_per_stage=(5, *[6] * 8, *[5] * 7))
    assert layout.overrides().endswith(
        " parallel.ep=1 parallel.pp_layers_per_stage=[5,6,6,6,6,6,6,6,6,5,5,5,5,5,5,5]"
    )
    assert problems(shipped("llama-80b"), layout, 8192) == []
    result = plan(shipped("llama-80b"), Machine(nhosts=64, **AURORA), work(8192, 372))
    chosen = result.chosen.layout
    assert chosen.pp > 1 and chosen.pp_layers_per_stage is not None
    assert sum(chosen.pp_layers_per_stage) == 88


def test_a_tiny_model_picks_dp():
    machine = Machine(nhosts=1, ppn=4, gpu_mem_gib=16)
    result = plan(shipped("tiny-cpu"), machine, work(128, 32))
    assert result.chosen.rung == "DP" and result.chosen.layout == Layout(dp_replicate=4)
    assert_a_sound_choice(result)


def test_a_batch_too_small_for_the_dp_degree_is_rejected_with_the_reason():
    # 12 samples of 128 tokens on 16 ranks: every layout with 16 data-parallel ranks is refused
    # for the batch, though it fits in memory; the choice has a data-parallel degree dividing 12.
    tiny = shipped("tiny-cpu")
    result = plan(tiny, Machine(nhosts=2, ppn=8, gpu_mem_gib=16), work(128, 12))
    dp = result.candidates[0]
    assert dp.reason.startswith("fits in 1.6 GiB per device, but the global batch of 12 samples ")
    assert "does not split into micro-batches of 1 on 16 data-parallel ranks" in dp.reason
    assert "critical batch" in dp.reason
    assert 12 % result.chosen.layout.dp == 0
    assert_a_sound_choice(result)


def test_no_split_proposes_the_nearest_batches():
    # 16 ranks and sequences of 2 tokens: tp at most 2 (sequence parallelism splits the 2),
    # no cp (its 2 cp chunks need 2 tokens each), pp at most 2 (a stage a host), so at least 4
    # data-parallel ranks: 7 samples split nowhere, and 4 would leave a pipeline of 2 stages
    # one micro-batch (1F1B refuses): 16 is the nearest.
    machine = Machine(nhosts=2, ppn=8, gpu_mem_gib=16)
    hopeless = plan(shipped("moe-small"), machine, work(2, 7))
    assert hopeless.chosen is None
    what, fix = hopeless.failure()
    assert what.startswith("no layout splits the global batch of 7 samples")
    assert [n.samples for n in hopeless.nearest] == [16]
    assert "the nearest that do: 16 samples (--gbs-tokens 32: pp 2 x dp_shard 4 x tp 2" in what
    assert "--gbs-tokens" in fix
    # 10: 8 below and 16 above.
    ten = plan(shipped("moe-small"), machine, work(2, 10))
    assert [n.samples for n in ten.nearest] == [8, 16]


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
    result = plan(model, Machine(nhosts=32, **AURORA), work(4096, 4096))
    assert result.warnings[0] == warning


def test_tp_across_hosts_is_a_warning():
    assert tp_across_hosts(Layout(tp=4, dp_shard=6), nhosts=2, ppn=12) is None
    assert tp_across_hosts(Layout(tp=5), nhosts=1, ppn=12) is None  # one host
    for tp in (8, 16, 24):
        warning = tp_across_hosts(Layout(tp=tp), nhosts=2, ppn=12)
        assert warning.startswith(f"tp = {tp} does not divide the 12 ranks per host")
        assert "span hosts" in warning
    result = plan(
        shipped("llama-20b"), Machine(nhosts=8, **AURORA), work(4096, 384), given=Layout(tp=16)
    )
    assert result.warnings[0].startswith("the config's [parallel]: tp = 16 does not divide the 12")


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


def test_a_moe_model_gets_ep_and_weighs_tp_and_cp():
    machine = Machine(nhosts=1, ppn=8, gpu_mem_gib=64)
    result = plan(MOE, machine, work(4096, 8))
    assert_a_sound_choice(result)
    fsdp = next(c for c in result.candidates if c.layout == Layout(dp_shard=8))
    ep2 = next(c for c in result.candidates if c.layout == Layout(dp_shard=8, ep=2))
    # The experts' state shards the same (16 x 1,207,959,552 x 18 / 8 either way); the
    # gathered experts halve: 2 blocks x 1,207,959,552 / 2 x 2 bytes fewer.
    assert ep2.breakdown.state == fsdp.breakdown.state
    gathered = fsdp.breakdown.gathered - ep2.breakdown.gathered
    assert gathered == pytest.approx(2 * 1_207_959_552 // 2 * 2)
    assert not fsdp.fits and ep2.fits and ep2.cost.ep > 0
    assert result.chosen.rung == "EP" and result.chosen.layout.overrides().endswith("ep=4")
    short = plan(MOE, Machine(nhosts=1, ppn=8, gpu_mem_gib=48), work(4096, 8))
    assert short.chosen is None
    # TP and CP are weighed like a dense model's (refused only by the trainer's own check);
    # PP needs more than one host.
    assert {"TP", "CP"} <= {c.rung for c in short.candidates if c.layout is not None}
    skipped = {c.rung: c.reason for c in short.candidates if c.layout is None}
    assert skipped == {"PP": "skipped: one host: pipeline stages go across hosts"}


def test_ep_is_skipped_when_the_experts_are_few():
    # 18 x 2 experts x 3 x 4096 x 64 = 28,311,552 routed-expert parameters of 1,045,729,280.
    few = replace(MOE, moe=MoEConfig(num_experts=2, top_k=1, expert_ffn_dim=64))
    result = plan(few, Machine(nhosts=1, ppn=8, gpu_mem_gib=1), work(4096, 8))
    ep = next(c for c in result.candidates if c.rung == "EP")
    assert ep.layout is None and ep.reason.startswith("skipped: the routed experts are 3% of")


def test_a_layout_the_trainer_refuses_is_rejected_with_the_trainers_reason():
    model = shipped("tiny-cpu")  # 4 heads, 2 kv heads, 4 layers
    assert problems(model, Layout(tp=2, dp_shard=2), 128) == []
    assert problems(model, Layout(tp=4), 128) == ["tp = 4 does not divide model.num_kv_heads = 2"]
    assert problems(model, Layout(cp=3, tp=2), 128)[0].startswith("tp = 2 does not divide the")
    assert problems(model, Layout(ep=2, dp_shard=2), 128)[0].startswith("ep = 2 needs a mixture")
    moe = shipped("moe-small")  # 8 experts
    assert problems(moe, Layout(ep=4, dp_shard=2), 128)[0].startswith(
        "ep = 4 does not divide dp_shard = 2"
    )


def test_a_pipeline_with_fewer_micro_batches_than_stages_is_refused_as_the_trainer_does():
    """1F1B, the trainer's default schedule, needs at least pp micro-batches per step: the 8B
    recipe's 8 samples on 32 x 8 devices leave pp 4 one sample per pipeline, which the trainer
    refuses at start (``pipeline_microbatches``); the planner must not choose it."""
    model = shipped("llama-8b")
    machine = Machine(nhosts=32, **H100)
    one_each = Layout(pp=4, dp_replicate=1, dp_shard=8, tp=8)
    candidate = evaluate(model, machine, work(8192, 8), rates(8), one_each, "PP")
    assert not candidate.fits
    assert "pp_schedule '1f1b' with 1 micro-batches on pp = 4" in (candidate.reason or "")
    four_each = evaluate(model, machine, work(8192, 32), rates(8), one_each, "PP")
    assert "pp_schedule" not in (four_each.reason or "")


def test_a_machine_listing_too_many_layouts_is_refused_before_any_is_weighed():
    # 110,880 hosts (144 divisors) x 840 devices (32): the splits multiply past the bound; the
    # refusal names the options and a power-of-two count of hosts, and comes at once.
    model = replace(shipped("llama-20b"), num_heads=2520, num_kv_heads=2520, dim=720720)
    model = replace(model, ffn_dim=720720, vocab_size=720720)
    machine = Machine(nhosts=110880, ppn=840, gpu_mem_gib=80)
    began = time.monotonic()
    with pytest.raises(GoodputError) as refused:
        plan_layout(model, machine, work(8192, 1440), rates(840))
    assert time.monotonic() - began < 30  # generous: listing the layouts takes about a second
    assert refused.value.where == "--nhosts/--ppn" and refused.value.code == ExitCode.USAGE
    assert f"more than {MAX_CANDIDATES:,} layouts to weigh" in refused.value.what
    # Each layout in the three checkpointing modes weighed by default: fewer settings help too.
    assert refused.value.what.endswith(
        "each weighed in 3 setting(s) of checkpointing, fp8 and compile"
    )
    assert refused.value.fix.startswith("plan for a count of hosts with fewer divisors")
    assert "e.g. --nhosts 65536, or allow fewer settings (--activation-checkpointing" in (
        refused.value.fix
    )
