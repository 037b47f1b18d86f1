"""The bf16 freeze detector on the seed's case: pure-bf16 weights whose RMSNorm gains stay at
exactly 1.0 while the loss falls are named; fp32 weights are not; FSDP shards merged over two
gloo ranks give the one-process report; the fingerprint sees every change of bits."""

import re

import pytest
import torch
from torch.distributed.tensor import DTensor

from goodput.testing.dist import run_distributed
from goodput.testing.tiny import TINY_MODEL, rank_micro_batches, uneven_global_batch
from goodput.train.config.parallel import ParallelConfig
from goodput.train.model import Transformer
from goodput.train.monitor import freeze
from goodput.train.monitor.freeze import CHUNK_WORDS, Fingerprints, FreezeDetector, FreezeReport
from goodput.train.parallel.parallelize import parallelize
from goodput.train.step import forward_backward

NUM_STEPS, INTERVAL = 30, 10
NORMS = {"norm.weight"} | {
    f"blocks.{layer}.{norm}.weight"
    for layer in range(TINY_MODEL.num_layers)
    for norm in ("attention_norm", "mlp_norm")
}


def train_and_check(model, micro_batches, num_steps, lr=3e-4):
    """``train_step``'s forward/backward and step on one repeated batch, the detector around
    the step on due steps; (losses, last report)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    detector = FreezeDetector(list(model.named_parameters()), interval=INTERVAL)
    losses, report = [], None
    for step in range(1, num_steps + 1):
        result = forward_backward(model, micro_batches)
        losses.append(result.loss_sum / result.num_tokens)
        if detector.due(step):
            detector.before_step()
        optimizer.step()
        if detector.due(step):
            report = detector.after_step(step)
        optimizer.zero_grad(set_to_none=True)
    return losses, report


def single_process(precision, num_steps=NUM_STEPS):
    torch.manual_seed(0)
    model = parallelize(
        Transformer(TINY_MODEL), ParallelConfig(data_parallel="replicate", precision=precision)
    )
    losses, report = train_and_check(model, [uneven_global_batch()], num_steps)
    return model, losses, report


@pytest.mark.parametrize("fingerprint_everything", [False, True])
def test_pure_bf16_norm_gains_freeze_at_one_and_are_named(monkeypatch, fingerprint_everything):
    if fingerprint_everything:  # no copies: every tensor's "unchanged" from its fingerprint
        monkeypatch.setattr(freeze, "COPY_LIMIT_BYTES", 0)
    model, losses, report = single_process("pure-bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert losses[-1] < losses[0] - 0.3  # the loss looks like training...
    norms = {name for name, _ in model.named_parameters() if "norm" in name}
    assert norms == NORMS
    for name, parameter in model.named_parameters():  # ...while the gains never moved
        if name in norms:
            assert bool((parameter == 1.0).all()), name
    assert set(report.frozen_tensors) >= norms
    assert report.previous_check == NUM_STEPS - INTERVAL
    for name in norms:
        tensor = report.tensors[name]
        assert tensor.share == 1.0 and tensor.unchanged and tensor.counted == TINY_MODEL.dim
    assert 0 < report.frozen_fraction < 0.5  # the matrices keep most of their updates
    line = report.warning()
    assert line.startswith(f"warning: bf16 freeze: step {NUM_STEPS}: ")
    assert 'precision = "fp32-master"' in line and "\n" not in line
    for name in sorted(norms):
        assert f"{name} 100% (unchanged since step {NUM_STEPS - INTERVAL})" in line
    listed = re.findall(r"([\w.]+) \d+%", line)
    assert listed == report.frozen_tensors  # every frozen tensor, sorted by name


def test_fp32_master_weights_keep_every_update():
    model, losses, report = single_process("fp32")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert losses[-1] < losses[0] - 0.3
    assert report.frozen_tensors == [] and report.warning() is None
    assert report.frozen_fraction < 1e-3
    assert not any(tensor.unchanged for tensor in report.tensors.values())


def fsdp_check(rank, world_size, num_steps):
    torch.manual_seed(0)
    model = parallelize(Transformer(TINY_MODEL), ParallelConfig(precision="pure-bf16"))
    micro = rank_micro_batches(*uneven_global_batch(), rank, world_size, accumulation=1)
    _, report = train_and_check(model, micro, num_steps)
    norm = model.blocks["0"].attention_norm.weight
    local_rows = norm.to_local().numel() if isinstance(norm, DTensor) else None
    return report, local_rows, str(norm.dtype)


def test_fsdp_shards_merged_over_ranks_give_the_one_process_report():
    num_steps = 2 * INTERVAL  # two checks: the second knows "unchanged"
    _, _, reference = single_process("pure-bf16", num_steps)
    results = run_distributed(fsdp_check, 2, num_steps, timeout_s=240)  # shared CPUs
    for report, local_rows, dtype in results:
        assert local_rows == TINY_MODEL.dim // 2 and dtype == "torch.bfloat16"  # shards
        assert report == results[0][0]  # the same merged report on every rank
        assert report.frozen_tensors == reference.frozen_tensors
        assert set(report.tensors) == set(reference.tensors)
        for name, tensor in reference.tensors.items():
            merged = report.tensors[name]
            # Shards add up to the whole tensor. (A few gradient entries of the matrices can be
            # exactly 0 on one side only: bf16 sums over ranks in another order.)
            assert merged.counted == pytest.approx(tensor.counted, rel=0.01), name
            assert merged.unchanged == tensor.unchanged, name
            if name in NORMS:
                assert merged == tensor
            assert merged.share == pytest.approx(tensor.share, abs=0.05), name


def test_zero_gradients_are_not_counted_and_a_stuck_tensor_is_named():
    big = torch.nn.Parameter(torch.zeros(64, 1024))  # fingerprinted, not copied
    untouched = torch.nn.Parameter(torch.ones(8))
    detector = FreezeDetector([("big", big), ("untouched", untouched)], interval=5)
    reports = []
    for step in (5, 10):
        big.grad = torch.zeros_like(big)
        big.grad[0] = 1.0  # one row with a gradient, which the "optimizer" ignores
        untouched.grad = torch.zeros_like(untouched)
        detector.before_step()
        with torch.no_grad():
            big[1:] += 1.0  # rows without a gradient move: not counted
        reports.append(detector.after_step(step))
    first, second = reports
    assert first.tensors["big"].counted == 1024 and first.tensors["big"].share == 1.0
    assert first.tensors["untouched"].counted == 0 and not first.tensors["untouched"].unchanged
    assert first.frozen_tensors == ["big"] and not first.tensors["big"].unchanged
    assert not second.tensors["big"].unchanged  # rows 1.. moved since step 5
    assert second.tensors["untouched"].unchanged and second.frozen_tensors == ["big"]


def test_unchanged_since_the_last_check_is_frozen_even_with_a_low_share():
    weight = torch.nn.Parameter(torch.zeros(4, 8192))  # 128 KiB: fingerprinted
    detector = FreezeDetector([("w", weight)], interval=2, threshold=0.9)
    weight.grad = torch.ones_like(weight)
    detector.before_step()
    with torch.no_grad():
        weight[:2] += 1.0  # step 2: half the entries move
    first = detector.after_step(2)
    assert first.tensors["w"].share == 0.5 and not first.tensors["w"].unchanged
    assert first.frozen_tensors == []
    with torch.no_grad():
        weight[:2] += 1.0  # step 3, not checked
    detector.before_step()
    with torch.no_grad():
        weight[:2] -= 1.0  # step 4 takes them back to where step 2 left them
    second = detector.after_step(4)
    assert second.tensors["w"].share == 0.5 and second.tensors["w"].unchanged
    assert second.frozen_tensors == ["w"]
    assert "w 50% (unchanged since step 2)" in second.warning()


def test_discard_forgets_the_copy_and_settings_are_checked():
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    detector = FreezeDetector([("w", weight)], interval=7)
    assert [s for s in range(1, 22) if detector.due(s)] == [7, 14, 21]
    detector.before_step()
    detector.discard()
    with pytest.raises(AssertionError):
        detector.after_step(7)
    for kwargs in ({"interval": 0}, {"threshold": 1.0}, {"threshold": -0.1}):
        with pytest.raises(ValueError):
            FreezeDetector([("w", weight)], **kwargs)
    with pytest.raises(ValueError, match="unique"):
        FreezeDetector([("w", weight), ("w", weight)])


def test_a_report_with_nothing_frozen_has_no_warning():
    report = FreezeReport(100, None, 0.5, {"w": freeze.TensorFreeze(10, 100, False)})
    assert report.frozen_fraction == 0.1 and report.frozen_tensors == []
    assert report.warning() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fingerprint_sees_changes_a_plain_or_float_sum_misses(dtype):
    fingerprints = Fingerprints()
    tensor = torch.linspace(-1, 1, 3 * CHUNK_WORDS + 17).to(dtype)  # several chunks
    reference = fingerprints.of(tensor)
    assert fingerprints.of(tensor.clone()) == reference == Fingerprints().of(tensor)
    bits = tensor.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    for changes in (
        {5: 1},  # one unit in the last place
        {5: 1, 6: -1},  # a plain sum of the bits would cancel
        {5: 1, 5 + CHUNK_WORDS: -1},  # the same place in two chunks
        {0: 1, 1: -2, 2: 1},
    ):
        changed = bits.clone()
        for index, delta in changes.items():
            changed[index] += delta
        assert fingerprints.of(changed.view(dtype)) != reference, changes
    one = torch.ones(1024, dtype=torch.float32)
    nudged = one.clone()
    nudged[0] += 2**-23  # fp32 sum absorbs it: sum is still 1024.0
    assert float(one.sum()) == float(nudged.sum())
    assert fingerprints.of(one) != fingerprints.of(nudged)
