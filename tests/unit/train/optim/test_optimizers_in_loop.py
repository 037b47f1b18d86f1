"""Every optimizer kind through the real loop on 2 gloo ranks: the loss falls and a resume from
a checkpoint continues bit for bit (losses and every saved tensor); QK-clip, SophiaG's Hessian
refresh and the LR scaling rule, as the loop applies them."""

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from goodput.checkpoint.save import list_checkpoints, step_dir
from goodput.rundir import checkpoints_dir
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import tiny_run_config
from goodput.train.config.model import MoEConfig
from goodput.train.config.optim import OptimConfig
from goodput.train.config.run import DiagnosticsConfig, RunConfig
from goodput.train.loop import train
from goodput.train.model import Transformer

KINDS = {
    "lamb": OptimConfig(kind="lamb"),
    "sophiag": OptimConfig(kind="sophiag", betas=(0.965, 0.99), sophia_hessian_interval=3),
    "muon": OptimConfig(kind="muon"),
    "muon-spectral-nesterov": OptimConfig(kind="muon", muon_lr_rule="spectral", nesterov=True),
    "mano": OptimConfig(kind="mano"),
}


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
RUN_TIMEOUT_S = 120.0  # run_distributed's default bound, for each run a shared spawn holds
# A test that may set up `two_rank_runs` holds all its runs (a straight run and a resume per
# kind, a split run per layout, QK-clip's and the GNS run's): past the sum of their bounds.
SHARED_RUNS_TIMEOUT_S = int(RUN_TIMEOUT_S * (2 * len(KINDS) + len(LAYOUTS) + 2)) + 60
QK_CLIP_TAU = 0.02  # below the tiny model's largest logits (about 0.08 at init)


def train_each_on_rank(rank, world_size, cfgs):
    """Each run of ``cfgs`` (name: config) in turn, in this rank's one process group; the
    losses by name. The run that fails is named in the traceback the parent re-raises."""
    losses = {}
    for name, cfg in cfgs.items():
        try:
            losses[name] = train(cfg)
        except BaseException as error:
            error.add_note(f"in the two-rank run {name!r}")
            raise
    return losses


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


@dataclass(frozen=True)
class TwoRankRuns:
    """This module's runs by name: each one's config, and rank 0's losses of the two-rank ones
    (the ``/one`` references are left to their tests to run in-process)."""

    configs: dict[str, RunConfig]
    losses: dict[str, list[float]]


def _resume_runs(directory, kind):
    """A straight run and its resume from the straight run's first save (at step 4)."""
    run_config = tiny_run_config(directory)
    straight = with_optimizer(run_config, KINDS[kind], directory / "straight")
    first_save = step_dir(checkpoints_dir(straight.train.run_dir), 4)
    resumed = with_optimizer(run_config, KINDS[kind], directory / "resumed", resume=str(first_save))
    return {f"{kind}/straight": straight, f"{kind}/resumed": resumed}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Every two-rank run of this module, in two spawned process groups rather than one per run:
    a spawn (two fresh interpreters importing torch) costs several tiny runs. The resumes come
    in the second group, so that each one starts, as a restarted job does, in a process that did
    not write its checkpoint."""
    configs: dict[str, RunConfig] = {}
    for kind in KINDS:
        configs |= _resume_runs(tmp_path_factory.mktemp(kind), kind)
    for case in LAYOUTS:
        configs |= _layout_runs(tmp_path_factory.mktemp(case), case)
    configs["qk-clip"] = _qk_clip_run(tmp_path_factory.mktemp("qk-clip"))
    configs["gns"] = _gns_run(tmp_path_factory.mktemp("gns"))
    resumes = {name: cfg for name, cfg in configs.items() if name.endswith("/resumed")}
    first = {
        name: cfg
        for name, cfg in configs.items()
        if name not in resumes and not name.endswith("/one")
    }
    losses: dict[str, list[float]] = {}
    for group in (first, resumes):
        timeout_s = RUN_TIMEOUT_S * len(group)
        losses |= run_distributed(train_each_on_rank, 2, group, timeout_s=timeout_s)[0]
    return TwoRankRuns(configs, losses)


@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS)
def test_each_optimizer_trains_on_two_ranks_and_resumes_bit_exactly(two_rank_runs, tmp_path, kind):
    straight = two_rank_runs.configs[f"{kind}/straight"]
    losses = two_rank_runs.losses[f"{kind}/straight"]
    assert len(losses) == 8 and all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) < sum(losses[:3]) and losses[-1] < losses[0], losses
    saved = list_checkpoints(checkpoints_dir(straight.train.run_dir))
    assert [c.step for c in saved] == [4, 8]

    resumed_cfg = two_rank_runs.configs[f"{kind}/resumed"]
    # Named before the straight run had saved: it must be the first save it lists.
    assert resumed_cfg.checkpoint.resume == str(saved[0].path)
    assert two_rank_runs.losses[f"{kind}/resumed"] == losses[4:]
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


def _qk_clip_run(directory):
    optim = OptimConfig(kind="muon", qk_clip=QK_CLIP_TAU)
    return with_optimizer(tiny_run_config(directory), optim, directory / "run")


@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
def test_qk_clip_runs_in_the_loop_and_logs_the_largest_logit(two_rank_runs):
    tau = QK_CLIP_TAU
    cfg = two_rank_runs.configs["qk-clip"]
    losses = two_rank_runs.losses["qk-clip"]
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


def _gns_run(directory):
    run_config = tiny_run_config(directory)
    return replace(
        run_config,
        train=replace(run_config.train, steps=12, run_dir=str(directory / "run")),
        diagnostics=DiagnosticsConfig(gns_ema=0.5),
    )


@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
def test_gns_is_logged_under_data_parallelism(two_rank_runs):
    cfg = two_rank_runs.configs["gns"]
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


def _layout_runs(directory, case):
    """The case's run on one process (``/one``) and under its split layout on two (``/split``)."""
    kind, parallel = LAYOUTS[case]
    run_config = tiny_run_config(directory)
    # tp splits the vocabulary: 64 rows (the counting corpus uses ids below 61)
    moe = MOE if "ep" in parallel else None
    run_config = replace(run_config, model=replace(run_config.model, vocab_size=64, moe=moe))
    one = with_optimizer(run_config, KINDS[kind], directory / "one")
    split = replace(
        with_optimizer(run_config, KINDS[kind], directory / "split"),
        parallel=replace(run_config.parallel, **parallel),
    )
    return {f"{case}/one": one, f"{case}/split": split}


@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
@pytest.mark.parametrize("case", LAYOUTS)
def test_each_optimizer_under_a_split_layout_logs_the_one_process_losses(two_rank_runs, case):
    expected = train(two_rank_runs.configs[f"{case}/one"])
    losses = two_rank_runs.losses[f"{case}/split"]
    assert losses == pytest.approx(expected, rel=1e-4)
