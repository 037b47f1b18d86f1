"""The step-cost model against published measurements (``goodput.plan.calibration``): every row
within ``TOLERANCE`` of its measurement, and through ``goodput plan layout --device NAME
--layout-from-config`` the same estimate (the trainer takes every row's layout); the rows of
one machine ranked by the estimate as measured; the devices' constants what the fit gives on
the fitted half, and no more than half of the rows fitted; docs/plan.md's tables of rows and
devices as the calibration prices them."""

from __future__ import annotations

import json
from itertools import combinations

import pytest

from goodput.cli import main
from goodput.commands.plan import DEVICE_NAMES
from goodput.plan.calibration import (
    DEVICES,
    MEASUREMENTS,
    TOLERANCE,
    Device,
    Measurement,
    error,
    estimate,
    fit,
)
from goodput.plan.layout import problems
from goodput.testing.jobs import REPO


def test_at_most_half_of_the_rows_are_fitted_and_each_device_has_a_held_out_row():
    fitted = [row for row in MEASUREMENTS if row.fitted]
    assert 0 < len(fitted) <= len(MEASUREMENTS) / 2
    for name in {row.device for row in fitted}:
        assert any(row.device == name and not row.fitted for row in MEASUREMENTS)
    assert set(DEVICES) == set(DEVICE_NAMES)


def test_the_shipped_constants_are_the_fit_of_the_fitted_half():
    fitted = fit()
    for name, device in DEVICES.items():
        for constant in ("tflops", "compile", "fp8_rowwise", "fp8_tensorwise"):
            shipped, again = getattr(device, constant), getattr(fitted[name], constant)
            assert (shipped is None) == (again is None), (name, constant)
            if shipped is not None:
                assert shipped == pytest.approx(again, rel=0.005), (name, constant)
    # The held-out rows play no part: changing their measurements changes nothing.
    scaled = tuple(
        row if row.fitted else _replace(row, tokens_per_s=row.tokens_per_s * 3)
        for row in MEASUREMENTS
    )
    assert fit(scaled) == fitted


def _replace(row: Measurement, **changes) -> Measurement:
    from dataclasses import replace

    return replace(row, **changes)


@pytest.mark.parametrize("row", MEASUREMENTS, ids=lambda row: row.name)
def test_every_row_is_estimated_within_the_tolerance(row):
    assert abs(error(row, DEVICES[row.device])) <= TOLERANCE


def test_the_rows_of_one_machine_rank_as_measured():
    for a, b in combinations(MEASUREMENTS, 2):
        if a.machine != b.machine or a.tokens_per_s == b.tokens_per_s:
            continue
        device_a, device_b = DEVICES[a.device], DEVICES[b.device]
        measured = a.tokens_per_s / b.tokens_per_s - 1
        estimated = estimate(a, device_a) / estimate(b, device_b) - 1
        # Never the opposite order by more than 1% of the estimate: the model ties rows whose
        # only difference is communication it takes as hidden (8B on 8 and on 128 GPUs,
        # measured 2.7 to 3.0% apart, estimated equal).
        assert measured * estimated >= 0 or abs(estimated) < 0.01, (a.name, b.name)


def _toml(row: Measurement) -> str:
    model, layout = row.model, row.layout
    lines = ["[model]"]
    for key in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim",
                "max_seq_len", "tie_embeddings"):  # fmt: skip
        value = getattr(model, key)
        if value is not None:
            lines.append(f"{key} = {json.dumps(value)}")
    lines += [
        "[train]",
        f"seq_len = {row.seq_len}",
        f"micro_batch_size = {row.micro_batch_size}",
        f"tokens_per_step = {row.global_batch * row.seq_len}",
        "[parallel]",
        *(f"{name} = {value}" for name, value in layout.by_name().items()),
        f'activation_checkpointing = "{layout.activation_checkpointing}"',
        f"compile = {json.dumps(layout.compile)}",
    ]
    if layout.fp8 is not None:
        lines.append(f'fp8 = "{layout.fp8}"')
    if layout.pp_layers_per_stage is not None:
        lines.append(f"pp_layers_per_stage = {list(layout.pp_layers_per_stage)}")
    return "\n".join(lines) + "\n"


def test_the_trainer_takes_every_rows_layout():
    """Every row runs through the command below: the trainer takes each published layout as a
    config (torchtitan's 70B and 405B rows compile under tp 8, which it once refused)."""
    assert {row.name: problems(row.model, row.layout, row.seq_len) for row in MEASUREMENTS} == {
        row.name: [] for row in MEASUREMENTS
    }


@pytest.mark.parametrize("row", MEASUREMENTS, ids=lambda row: row.name)
def test_the_command_prices_each_row_as_the_calibration_does(row, tmp_path, capsys):
    config = tmp_path / "row.toml"
    config.write_text(_toml(row))
    code = main(
        ["plan", "layout", str(config), "--device", row.device, "--layout-from-config",
         "--nhosts", str(row.nhosts), "--ppn", str(row.ppn), "--gpu-mem-gb", "1000", "--json"]
    )  # fmt: skip
    assert code == 0
    record = json.loads(capsys.readouterr().out)
    layout = row.layout
    assert (record["activation_checkpointing"], record["fp8"], record["compile"]) == (
        layout.activation_checkpointing,
        layout.fp8,
        layout.compile,
    )
    world = row.nhosts * row.ppn
    tokens = row.global_batch * row.seq_len / record["cost_s"]["total"] / world
    assert tokens == pytest.approx(estimate(row, DEVICES[row.device]), rel=1e-3)


def table_row(row: Measurement) -> str:
    """``row`` as docs/plan.md's calibration table shows it."""
    device = DEVICES[row.device]
    return (
        f"| {row.name} | {row.device} | {row.layout.describe()} | {row.seq_len} x "
        f"{row.micro_batch_size} | {row.tokens_per_s:,.0f} | {estimate(row, device):,.0f} | "
        f"{error(row, device):+.1%} | {'fitted' if row.fitted else 'held out'} | {row.source} |"
    )


def device_row(device: Device) -> str:
    """``device`` as docs/plan.md's table of devices shows it."""
    fp8 = (
        f"x{device.fp8_rowwise:g} / x{device.fp8_tensorwise:g}"
        if device.fp8_rowwise is not None and device.fp8_tensorwise is not None
        else "none"
    )
    return (
        f"| `{device.name}` | {device.memory_gib:g} | {device.peak_tflops:g} | "
        f"{device.tflops:g} | {device.intra_gbps:g} | {device.inter_gbps:g} | {fp8} | "
        f"x{device.compile:g} |"
    )


def test_the_page_shows_every_row_and_device_as_the_calibration_prices_them():
    page = (REPO / "docs" / "plan.md").read_text()
    for row in MEASUREMENTS:
        assert table_row(row) in page, table_row(row)
    for device in DEVICES.values():
        assert device_row(device) in page, device_row(device)
