"""FP8 training (``[parallel] fp8``, torchao's float8 emulated on CPU): what is converted, what
is refused, and training in every layout that matters.

Training: the real ``train()`` with the bf16 policy (fp32-master), the tiny model widened so
that every converted weight is a multiple of 16 per rank under tp = 4. In one spawned group of 4
gloo ranks: rowwise in FSDP (dp_shard 4), TP (tp 4) and FSDP x TP (2 x 2); tensorwise, whose
FSDP gathers weights in float8, in FSDP and FSDP x TP; and bf16 in the two TP layouts. Each fp8
run's loss over its last steps stays within 2 % of the one-process bf16 loss (measured: 1.5 % at
most, tensorwise FSDP), and every layout logs the one-process run's loss of its own precision
within ``LAYOUT_TOLERANCE`` at every step, fp8 or not. That tolerance is wider than fp32's 1e-5
(test_layout_invariance.py) because bf16 compute rounds the layouts' different summation orders
differently, and fp8 widens it again: a sum that lands on the other side of an FP8 rounding
step moves by 1/16. Measured: bf16 layouts within 0.44 % of one process, fp8 layouts within
1.9 % (tensorwise FSDP x TP; rowwise FSDP 0.07 %).

The issue asks for 200 steps of the demo. Measured by hand on this 2-core machine (shared, under
load): 200 steps of configs/tiny-cpu.toml's model and batch on 2 ranks in FSDP took 417 s of
step time in bf16 and 530 s in emulated rowwise fp8 (final losses 0.00772 and 0.00794 on the
counting corpus, which the model learns by heart; the mean of the last 10 steps 1.2 % apart);
three layouts would be ~25 minutes of CI. So CI trains ``NUM_STEPS`` steps of the tiny model (the
whole file ~5 minutes on that loaded machine, most of it the two tp = 4 runs): the loss falls
from ln(64) by a third, far enough for a broken fp8 path to show.

Checkpoints: the tensorwise FSDP run saves; a bf16 run resumes from it and saves; an fp8 run
resumes from that. Each resumed run's first loss continues where the saved run stopped (a
weight lost or mis-cast in the load would put it back near ln(vocab)), and the converted model
holds the same state-dict keys and dtypes as the plain one.
"""

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from goodput.checkpoint.config import CheckpointConfig
from goodput.errors import GoodputError
from goodput.rundir import checkpoints_dir, step_dir
from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL, tiny_run_config
from goodput.train import device
from goodput.train.config.model import MoEConfig
from goodput.train.config.parallel import ParallelConfig
from goodput.train.config.run import RunConfig
from goodput.train.loop import train
from goodput.train.model import Transformer
from goodput.train.parallel import float8
from goodput.train.parallel.parallelize import parallelize

pytestmark = pytest.mark.timeout(900)

NUM_STEPS = 12
RESUMED_STEPS = 2
WORLD_SIZE = 4
VOCAB_SIZE = 64
# Every converted weight a multiple of 16 per rank under tp = 4 (heads x head dim = 64).
MODEL = replace(TINY_MODEL, vocab_size=VOCAB_SIZE, dim=64, num_kv_heads=4, ffn_dim=128)
BF16_TOLERANCE = 0.02  # the issue's: fp8 within 2 % of the bf16 loss
LAST_STEPS = 4
LAYOUT_TOLERANCE = 3e-2  # measured spreads: the module docstring
LAYOUTS: dict[str, dict[str, Any]] = {
    "rowwise,dp_shard=4": dict(fp8="rowwise", dp_shard=4),
    "rowwise,tp=4": dict(fp8="rowwise", tp=4),
    "rowwise,dp_shard=2,tp=2": dict(fp8="rowwise", dp_shard=2, tp=2),
    "tensorwise,dp_shard=4": dict(fp8="tensorwise", dp_shard=4),
    "tensorwise,dp_shard=2,tp=2": dict(fp8="tensorwise", dp_shard=2, tp=2),
}
# The same layouts without fp8, for how far bf16 compute alone moves a layout off one process.
BF16_LAYOUTS: dict[str, dict[str, Any]] = {
    "bf16,tp=4": dict(tp=4),
    "bf16,dp_shard=2,tp=2": dict(dp_shard=2, tp=2),
}
SAVED = "tensorwise,dp_shard=4"  # its checkpoint starts the round trip
ROUND_TRIP = ("bf16 from fp8", "fp8 from bf16")


def run_config(
    base: RunConfig, run_dir: Path, steps: int = NUM_STEPS, **parallel: Any
) -> RunConfig:
    return replace(
        base,
        model=MODEL,
        train=replace(base.train, steps=steps, run_dir=str(run_dir), tensorboard=False),
        parallel=replace(base.parallel, precision="fp32-master", fp8_emulate=True, **parallel),
        checkpoint=CheckpointConfig(interval_steps=steps, async_save=False),
    )


def losses(cfg: RunConfig) -> list[float]:
    lines = (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def train_each(rank: int, world_size: int, runs: list[RunConfig]) -> None:
    torch.set_num_threads(1)  # 4 ranks on 2 cores (test_layout_invariance.py says why)
    for cfg in runs:
        train(cfg)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("float8")
    base = tiny_run_config(root)
    references = {
        recipe: run_config(base, root / f"one-process-{recipe}", fp8=recipe)
        for recipe in (None, "rowwise", "tensorwise")
    }
    for cfg in references.values():
        train(cfg)
    cases = {
        name: run_config(base, root / name, **layout)
        for name, layout in (LAYOUTS | BF16_LAYOUTS).items()
    }
    saved = step_dir(checkpoints_dir(cases[SAVED].train.run_dir), NUM_STEPS)
    bf16 = run_config(base, root / ROUND_TRIP[0], NUM_STEPS + RESUMED_STEPS, dp_shard=4)
    bf16 = replace(bf16, checkpoint=replace(bf16.checkpoint, resume=str(saved)))
    back = run_config(
        base, root / ROUND_TRIP[1], NUM_STEPS + 2 * RESUMED_STEPS, fp8="tensorwise", dp_shard=4
    )
    saved_bf16 = step_dir(checkpoints_dir(bf16.train.run_dir), NUM_STEPS + RESUMED_STEPS)
    back = replace(back, checkpoint=replace(back.checkpoint, resume=str(saved_bf16)))
    run_distributed(train_each, WORLD_SIZE, [*cases.values(), bf16, back], timeout_s=800)
    return {"references": references, "cases": cases, "round_trip": (cases[SAVED], bf16, back)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_fp8_stays_within_2_percent_of_the_bf16_loss(runs, name):
    """The loss of the last steps (averaged over ``LAST_STEPS``: at this size one batch moves a
    step's loss by several percent either way) within 2 % of bf16's."""
    bf16 = losses(runs["references"][None])
    fp8 = losses(runs["cases"][name])
    assert len(fp8) == NUM_STEPS
    assert max(fp8[-LAST_STEPS:]) < 0.8 * math.log(VOCAB_SIZE)  # it trained
    late = sum(fp8[-LAST_STEPS:]) / LAST_STEPS
    assert late == pytest.approx(sum(bf16[-LAST_STEPS:]) / LAST_STEPS, rel=BF16_TOLERANCE)


@pytest.mark.parametrize("name", [*LAYOUTS, *BF16_LAYOUTS])
def test_a_layout_logs_the_one_process_loss_with_fp8_as_without(runs, name):
    """One tolerance for every layout, with fp8 or without: fp8 moves a layout no further off
    the one-process run than bf16 compute already does."""
    cfg = runs["cases"][name]
    reference = runs["references"][cfg.parallel.fp8]
    assert losses(cfg) == pytest.approx(losses(reference), rel=LAYOUT_TOLERANCE)


def test_a_checkpoint_goes_from_fp8_to_bf16_and_back(runs):
    saved, bf16, back = runs["round_trip"]
    bf16_losses, back_losses = losses(bf16), losses(back)
    # Resumed runs log only their own steps; each one's first continues the saved run's last.
    assert len(bf16_losses) == len(back_losses) == RESUMED_STEPS
    assert bf16_losses[0] == pytest.approx(losses(saved)[-1], rel=0.1)
    assert back_losses[0] == pytest.approx(bf16_losses[-1], rel=0.1)
    assert back_losses[-1] < 0.8 * math.log(VOCAB_SIZE)


def test_the_state_dict_is_the_plain_models():
    """Same keys, shapes and dtypes: checkpoints load across fp8 on and off."""
    plain = Transformer(MODEL).state_dict()
    model = Transformer(MODEL)
    float8.convert_blocks(
        model,
        ParallelConfig(fp8="tensorwise", fp8_emulate=True),
        device_type="cpu",
        gather_float8=True,
    )
    converted = model.state_dict()
    assert {key: (value.shape, value.dtype) for key, value in converted.items()} == {
        key: (value.shape, value.dtype) for key, value in plain.items()
    }


def test_only_the_blocks_linear_layers_are_converted():
    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16, shared_expert=True)
    model = parallelize(
        Transformer(replace(MODEL, moe=moe, tie_embeddings=False)),
        ParallelConfig(
            data_parallel="replicate", precision="fp32", fp8="rowwise", fp8_emulate=True
        ),
    )
    converted = {name for name, module in model.named_modules() if _is_float8(module)}
    assert converted == {
        f"blocks.{layer}.{name}"
        for layer in range(MODEL.num_layers)
        for name in (
            *(f"attention.{w}" for w in ("wq", "wk", "wv", "wo")),
            *(f"mlp.shared.{w}" for w in ("w1", "w2", "w3")),
        )
    }
    assert isinstance(model.output, nn.Linear) and not _is_float8(model.output)
    assert not _is_float8(model.blocks["0"].mlp.router)


def _is_float8(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


def test_fp8_on_cpu_is_refused_unless_emulated():
    with pytest.raises(GoodputError) as refused:
        float8.check(ParallelConfig(fp8="rowwise"), "cpu")
    line = refused.value.render()
    assert "\n" not in line and "FP8 matmuls" in line and "cpu (" in line
    assert "fp8_emulate = true" in line
    float8.check(ParallelConfig(fp8="rowwise", fp8_emulate=True), "cpu")


@pytest.mark.parametrize(
    ("capability", "hip_arch", "refused"),
    [((8, 0), None, "compute capability 8.0"), ((8, 9), None, None), ((9, 0), None, None)]
    + [((9, 4), "gfx90a:sramecc+:xnack-", "gfx90a"), ((9, 4), "gfx942:sramecc+:xnack-", None)],
)
def test_a_gpu_without_fp8_matmuls_is_named(capability, hip_arch, refused):
    properties = mock.Mock(gcnArchName=hip_arch)
    with (
        mock.patch.object(torch.cuda, "current_device", return_value=0),
        mock.patch.object(torch.cuda, "get_device_name", return_value="Some GPU"),
        mock.patch.object(torch.cuda, "get_device_capability", return_value=capability),
        mock.patch.object(torch.cuda, "get_device_properties", return_value=properties),
        mock.patch.object(torch.version, "hip", "6.2" if hip_arch else None),
    ):
        missing = device.fp8_matmuls_missing("cuda")
    if refused is None:
        assert missing is None
    else:
        assert missing is not None and refused in missing and "Some GPU" in missing


def test_fp8_without_torchao_names_the_extra():
    with (
        mock.patch.object(float8.importlib.util, "find_spec", return_value=None),
        pytest.raises(GoodputError, match=r"pip install goodput\[fp8\]"),
    ):
        float8.check(ParallelConfig(fp8="tensorwise", fp8_emulate=True), "cpu")


@pytest.mark.parametrize(
    ("model", "tp", "named"),
    [
        (dict(dim=72), 1, "model.dim = 72"),
        (dict(ffn_dim=96), 4, "model.ffn_dim = 96 / tp 4"),
        (dict(dim=32, num_kv_heads=2), 2, "model.num_kv_heads x head dim = 16 / tp 2"),
    ],
)
def test_a_layer_that_is_no_multiple_of_16_per_rank_is_refused(model, tp, named):
    cfg = replace(MODEL, **model)
    with pytest.raises(GoodputError, match=named):
        ParallelConfig(tp=tp, fp8="rowwise").check_model(cfg, seq_len=16)
    ParallelConfig(tp=tp).check_model(cfg, seq_len=16)  # fine without fp8


def test_torchaos_import_lines_stay_off_the_terminal():
    code = (
        "from goodput.train.parallel.float8 import _quiet_import\n"
        "with _quiet_import(): import torchao.float8"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Failed to load" not in done.stderr and "Enum subclass" not in done.stderr
