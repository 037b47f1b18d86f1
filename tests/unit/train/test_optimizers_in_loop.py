"""Every optimizer kind through the real loop on 2 gloo ranks: the loss falls and a resume from
a checkpoint continues bit for bit (losses and every saved tensor); QK-clip, SophiaG's Hessian
refresh and the LR scaling rule, as the loop applies them."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from goodput.checkpoint.save import list_checkpoints, step_dir
from goodput.rundir import checkpoints_dir
from goodput.testing.dist import run_distributed
from goodput.train.config import DiagnosticsConfig
from goodput.train.loop import train
from goodput.train.model import Transformer
from goodput.train.model_config import MoEConfig
from goodput.train.optim_config import OptimConfig

KINDS = {
    "lamb": OptimConfig(kind="lamb"),
    "sophiag": OptimConfig(kind="sophiag", betas=(0.965, 0.99), sophia_hessian_interval=3),
    "muon": OptimConfig(kind="muon"),
    "muon-spectral-nesterov": OptimConfig(kind="muon", muon_lr_rule="spectral", nesterov=True),
    "mano": OptimConfig(kind="mano"),
}


def train_on_rank(rank, world_size, cfg):
    return train(cfg)


def with_optimizer(cfg, optim, run_dir, **checkpoint):
    return replace(
        cfg,
        optim=optim,
        train=replace(cfg.train, run_dir=str(run_dir)),
        checkpoint=replace(cfg.checkpoint, interval_steps=4, **checkpoint),
    )


def saved_tensors(directory, tmp_path):
    out = tmp_path / f"{directory.parent.parent.name}-{directory.name}.pt"
    dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=True)


def assert_bitwise_equal(a, b, where=""):
    assert a.keys() == b.keys(), where
    for key in a:
        if isinstance(a[key], dict):
            assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), f"{where}.{key}"
        else:
            assert a[key] == b[key], f"{where}.{key}"


@pytest.mark.parametrize("kind", KINDS)
def test_each_optimizer_trains_on_two_ranks_and_resumes_bit_exactly(run_config, tmp_path, kind):
    optim = KINDS[kind]
    straight = with_optimizer(run_config, optim, tmp_path / "straight")
    losses = run_distributed(train_on_rank, 2, straight)[0]
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) < sum(losses[:3]) and losses[-1] < losses[0], losses
    saved = list_checkpoints(checkpoints_dir(straight.train.run_dir))
    assert [c.step for c in saved] == [4, 8]

    resumed_cfg = with_optimizer(run_config, optim, tmp_path / "resumed", resume=str(saved[0].path))
    assert run_distributed(train_on_rank, 2, resumed_cfg)[0] == losses[4:]
    final = step_dir(checkpoints_dir(resumed_cfg.train.run_dir), 8)
    assert_bitwise_equal(saved_tensors(saved[1].path, tmp_path), saved_tensors(final, tmp_path))


def test_sophia_refreshes_its_hessian_every_interval(run_config, tmp_path):
    cfg = with_optimizer(run_config, KINDS["sophiag"], tmp_path / "run")
    train(cfg)
    final = step_dir(checkpoints_dir(cfg.train.run_dir), 8)
    groups = json.loads((final / "train_state.json").read_text())["optimizer_param_groups"]
    # Refreshed after steps 1, 4 and 7 on the step's own batch: its target tokens.
    (tokens,) = {group["hessian_tokens"] for group in groups}
    assert 0 < tokens <= cfg.train.tokens_per_step
    state = saved_tensors(final, tmp_path)
    hessians = [v for k, v in _flatten(state) if k.endswith("hessian")]
    assert hessians and all(bool((h > 0).any()) for h in hessians)
    assert all(0 <= r["sophia_unclipped"] <= 1 for r in _records(cfg))


def _flatten(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_qk_clip_runs_in_the_loop_and_logs_the_largest_logit(run_config, tmp_path):
    tau = 0.02  # below the tiny model's largest logits (about 0.08 at init)
    cfg = with_optimizer(run_config, OptimConfig(kind="muon", qk_clip=tau), tmp_path / "run")
    losses = run_distributed(train_on_rank, 2, cfg)[0]
    assert losses[-1] < losses[0]
    logits = [r["max_attention_logit"] for r in _records(cfg)]
    # Each step's forwards start from weights clipped after the step before: their logits
    # sit near tau (a new batch may go a little past it), far below the unclipped 0.08.
    assert logits[0] > 2 * tau and all(value < 2 * tau for value in logits[1:]), logits


def test_the_lr_scales_by_the_rule_when_the_global_batch_changes(run_config, tmp_path, capsys):
    optim = OptimConfig(lr_scaling="sqrt")
    first = with_optimizer(run_config, optim, tmp_path / "first")
    train(first)
    saved = list_checkpoints(checkpoints_dir(first.train.run_dir))[0]
    doubled = with_optimizer(run_config, optim, tmp_path / "doubled", resume=str(saved.path))
    doubled = replace(doubled, train=replace(doubled.train, tokens_per_step=256))
    train(doubled)
    assert "lr x 1.414 (sqrt rule: global batch 256 tokens, the lr was tuned at 128)" in (
        capsys.readouterr().out
    )
    before = {r["step"]: r["lr"] for r in _records(first)}
    after = {r["step"]: r["lr"] for r in _records(doubled)}
    for step in range(5, 9):
        assert after[step] == pytest.approx(before[step] * 2**0.5, rel=1e-12)
    # The reference travels on: a second resume still scales against 128.
    state = json.loads(
        (step_dir(checkpoints_dir(doubled.train.run_dir), 8) / "train_state.json").read_text()
    )
    assert state["lr_reference_tokens"] == 128


def _records(cfg):
    lines = (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_gns_is_logged_under_data_parallelism(run_config, tmp_path):
    cfg = replace(
        run_config,
        train=replace(run_config.train, steps=12, run_dir=str(tmp_path / "run")),
        diagnostics=DiagnosticsConfig(gns_ema=0.5),
    )
    run_distributed(train_on_rank, 2, cfg)
    values = [r.get("gns") for r in _records(cfg)]
    assert all(v is None or math.isfinite(v) for v in values)
    assert values[-1] is not None


def test_gns_is_absent_on_one_rank(run_config, tmp_path):
    train(run_config)
    assert all("gns" not in r for r in _records(run_config))


def _frozen_run(run_config, tmp_path, precision, data_parallel):
    cfg = replace(
        run_config,
        train=replace(run_config.train, run_dir=str(tmp_path / precision)),
        schedule=replace(run_config.schedule, lr=1e-3),
        parallel=replace(run_config.parallel, precision=precision, data_parallel=data_parallel),
        diagnostics=DiagnosticsConfig(freeze_check_interval=4),
    )
    return cfg, train(cfg)


def test_the_freeze_check_names_every_norm_gain_under_pure_bf16(run_config, tmp_path, capsys):
    """The seed's case through the loop: bf16 weights, Adam steps of ~lr = 1e-3 that the
    matrices keep and the RMSNorm gains at 1.0 (half a bf16 spacing: 2e-3) lose."""
    cfg, losses = _frozen_run(run_config, tmp_path, "pure-bf16", "replicate")
    assert losses[-1] < losses[0]  # the loss still falls
    warnings = [
        line for line in capsys.readouterr().out.splitlines() if "warning: bf16 freeze:" in line
    ]
    assert len(warnings) == 2  # at steps 4 and 8
    model = Transformer(cfg.model)
    norms = [name for name, p in model.named_parameters() if name.endswith("norm.weight")]
    assert len(norms) == 2 * cfg.model.num_layers + 1
    for line in warnings:
        assert line.startswith("warning: bf16 freeze:")
        assert all(name in line for name in norms), line
    fractions = {r["step"]: r.get("frozen_fraction") for r in _records(cfg)}
    assert fractions[4] > 0 and fractions[8] > 0 and fractions[3] is None


def test_the_freeze_check_is_quiet_under_fp32_master(run_config, tmp_path, capsys):
    cfg, _ = _frozen_run(run_config, tmp_path, "fp32-master", "fsdp")
    assert "warning: bf16 freeze" not in capsys.readouterr().out
    fractions = [r["frozen_fraction"] for r in _records(cfg) if "frozen_fraction" in r]
    assert len(fractions) == 2 and max(fractions) < 0.01


LAYOUTS = {  # (kind, [parallel] overrides): each new optimizer under a layout that splits it
    "muon-tp2": ("muon", {"tp": 2}),
    "lamb-tp2": ("lamb", {"tp": 2}),
    "mano-pp2": ("mano", {"pp": 2}),
    "mano-tp2": ("mano", {"tp": 2}),
    "sophiag-pp2": ("sophiag", {"pp": 2}),
    "mano-cp2": ("mano", {"cp": 2}),
    "muon-moe-ep2": ("muon", {"ep": 2}),
}
MOE = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=32)


@pytest.mark.parametrize("case", LAYOUTS)
def test_each_optimizer_under_a_split_layout_logs_the_one_process_losses(
    run_config, tmp_path, case
):
    kind, parallel = LAYOUTS[case]
    # tp splits the vocabulary: 64 rows (the counting corpus uses ids below 61)
    moe = MOE if "ep" in parallel else None
    run_config = replace(run_config, model=replace(run_config.model, vocab_size=64, moe=moe))
    one = with_optimizer(run_config, KINDS[kind], tmp_path / "one")
    expected = train(one)
    split = replace(
        with_optimizer(run_config, KINDS[kind], tmp_path / "split"),
        parallel=replace(run_config.parallel, **parallel),
    )
    losses = run_distributed(train_on_rank, 2, split)[0]
    assert losses == pytest.approx(expected, rel=1e-4)
