"""``goodput diagnose smoke`` through the real CLI: a record holds the trainer's own numbers; a
rerun against it passes; a baseline one ulp off at step k fails naming step k, the metric and
both values, with the environment differences; a baseline of another config, step count,
device or multi-rank layout is a usage error before anything runs; a hostile baseline is one
line. A tensor-parallel run on 2 ranks matches the one-process record to the layouts' tolerance,
and the same run with the seed's regression (its logged loss a share of the real one) fails at
step 1's loss. The tolerances (peak memory, off-CPU devices, another layout) are checked on a
real record."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from goodput import cli
from goodput.config import to_toml
from goodput.diagnose.smoke import (
    LAYOUT_TOLERANCE,
    PEAK_MEMORY_TOLERANCE,
    first_difference,
    metric_tolerances,
)
from goodput.diagnose.smoke_record import MAX_RECORD_BYTES, read_record
from goodput.errors import ExitCode, GoodputError
from goodput.testing.jobs import outside_any_job
from goodput.testing.tiny import tiny_run_config

NUM_STEPS = 6
VOCAB_SIZE = 64  # divisible by tp = 2 (the tiny model's 61 is not)
TP2 = ("parallel.tp=2", "--nproc", "2")
# The seed's regression, on the children's PYTHONPATH as ``sitecustomize``: each launched rank
# logs the loss sum divided by the tensor-parallel degree, as if one rank's share of a sum over
# the wrong group were the whole; gradients and training are untouched, as in the seed.
SEEDS_REGRESSION = """
import dataclasses
import os

if "RANK" in os.environ:  # the launched ranks only
    import goodput.train.step as step

    real_forward_backward = step.forward_backward

    def forward_backward(*args, **kwargs):
        result = real_forward_backward(*args, **kwargs)
        return dataclasses.replace(result, loss_sum=result.loss_sum / 2)

    step.forward_backward = forward_backward
"""


def smoke(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "goodput", "diagnose", "smoke", *map(str, args)],
        capture_output=True,
        text=True,
        env=env or outside_any_job(),
        timeout=240,
    )


@pytest.fixture
def smoke_here(monkeypatch, capfd):
    """``smoke`` through ``cli.main`` in this process, in the environment ``smoke`` gives its
    child (``env`` on top): the same exit code and lines, without a second interpreter's start
    (about 2 s of importing torch, most of a usage error's time). The launched ranks are child
    processes either way, and their output is captured with this process's."""

    def run(*args, **env):
        wanted = outside_any_job(**env)
        for name in os.environ.keys() - wanted.keys():
            monkeypatch.delenv(name)
        for name, value in wanted.items():
            monkeypatch.setenv(name, value)
        capfd.readouterr()  # only this command's output
        code = cli.main(["diagnose", "smoke", *map(str, args)])
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(config file, record file) of a tiny run, recorded once."""
    folder = tmp_path_factory.mktemp("smoke")
    config = folder / "tiny.toml"
    cfg = tiny_run_config(folder)
    config.write_text(
        to_toml(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB_SIZE))
        )
    )
    record = folder / "record.json"
    result = smoke(config, "--steps", NUM_STEPS, "--record", record)
    assert result.returncode == 0, result.stderr
    assert f"smoke: recorded {NUM_STEPS} steps of {config} on 1 process in {record}" in (
        result.stdout
    )
    return config, record


def edited(record: Path, folder: Path, edit) -> Path:
    """A copy of ``record`` with ``edit`` applied to its JSON."""
    raw = json.loads(record.read_text())
    edit(raw)
    copy = folder / "baseline.json"
    copy.write_text(json.dumps(raw))
    return copy


def test_the_record_holds_the_trainers_own_numbers_bit_for_bit(recorded, tmp_path):
    config, record = recorded
    run_dir = tmp_path / "run"
    # The trainer as a user runs it, as the smoke does: one process, one intra-op thread.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "goodput",
            "train",
            config,
            f"train.steps={NUM_STEPS}",
            f"train.run_dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        env=outside_any_job(OMP_NUM_THREADS="1"),
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = read_record(record).steps
    assert [s.step for s in steps] == list(range(1, NUM_STEPS + 1))
    assert [(s.loss, s.grad_norm) for s in steps] == [(m["loss"], m["grad_norm"]) for m in metrics]
    assert steps[-1].loss < steps[0].loss  # a real run: it learns
    raw = json.loads(record.read_text())
    assert raw["format"] == "goodput-smoke" and raw["version"] == 2 and raw["world_size"] == 1
    environment = raw["environment"]
    assert environment["torch"] == torch.__version__ and environment["device"] == "cpu"
    assert environment["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert environment["python"] == ".".join(map(str, sys.version_info[:3]))
    # Machine-local paths are not part of what is compared.
    assert str(config.parent) not in record.read_text()


def drop_new_keys(raw):  # as a record made before [parallel] had them reads
    new = ("loss_parallel = ", "pp_schedule = ")
    kept = [line for line in raw["config"] if not line.startswith(new)]
    assert len(kept) == len(raw["config"]) - 2
    raw["config"] = kept


def test_a_rerun_matches_its_record_even_inside_a_job_and_from_before_new_keys(recorded, tmp_path):
    config, record = recorded
    # One rerun of the record's run for both: a key goodput gained since the recording counts
    # as its default (the same layout: compared bit for bit, no "against" in the line).
    baseline = edited(record, tmp_path, drop_new_keys)
    # Rank variables and the allocation of some Slurm job around it: the smoke still runs as one
    # local process (without the placement stripped, the child would wait for 3 other ranks
    # until the timeout; without the allocation, goodput launch would start it through srun).
    env = outside_any_job(
        RANK="1",
        WORLD_SIZE="4",
        SLURM_PROCID="1",
        SLURM_NTASKS="4",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[1-2]",
    )
    result = smoke(config, "--baseline", baseline, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"smoke: OK: {NUM_STEPS} steps match {baseline} (loss and grad_norm bit for bit, peak "
        f"memory within {100 * PEAK_MEMORY_TOLERANCE:g}%; environment: no differences seen)"
    )


def test_a_tensor_parallel_run_logs_the_one_process_numbers(recorded, smoke_here):
    config, record = recorded
    result = smoke_here(config, *TP2, "--baseline", record)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"smoke: OK: {NUM_STEPS} steps match {record} (2 ranks (tp=2) against 1 process; loss "
        f"within {100 * LAYOUT_TOLERANCE['loss']:g}%, grad_norm within "
        f"{100 * LAYOUT_TOLERANCE['grad_norm']:g}%, peak memory not compared; environment: no "
        "differences seen)"
    )


def test_the_seeds_regression_fails_the_gate_at_step_1s_loss(recorded, tmp_path, smoke_here):
    config, record = recorded
    (tmp_path / "sitecustomize.py").write_text(SEEDS_REGRESSION)
    pythonpath = f"{tmp_path}:{outside_any_job()['PYTHONPATH']}"
    result = smoke_here(config, *TP2, "--baseline", record, PYTHONPATH=pythonpath)
    assert result.returncode == 1, result.stderr
    expected = read_record(record).steps[0].loss
    line = result.stderr.splitlines()[-1]
    prefix = f"smoke: step 1 loss differs by more than {100 * LAYOUT_TOLERANCE['loss']:g}%: "
    assert line.startswith(f"{prefix}baseline {expected!r} vs now ")
    now = float(line.removeprefix(prefix).split(" vs now ")[1].split()[0])
    assert now == pytest.approx(expected / 2, rel=LAYOUT_TOLERANCE["loss"])
    assert "(2 ranks (tp=2) against 1 process; environment: " in line


def test_one_ulp_at_step_k_fails_there_with_both_values_and_the_environment(recorded, tmp_path):
    config, record = recorded
    steps = read_record(record).steps
    k = 4
    exact = steps[k - 1].grad_norm
    off_by_one_ulp = math.nextafter(exact, math.inf)

    def edit(raw):
        raw["steps"][k - 1]["grad_norm"] = off_by_one_ulp
        raw["steps"][k]["loss"] *= 2  # a later, larger difference: the first one is reported
        raw["environment"]["torch"] = "2.12.0"
        raw["environment"]["git_sha"] = "abc123"

    result = smoke(config, "--baseline", edited(record, tmp_path, edit))
    assert result.returncode == 1, result.stderr
    line = result.stderr.splitlines()[-1]
    assert line.startswith(
        f"smoke: step {k} grad_norm differs: baseline {off_by_one_ulp!r} vs now {exact!r} "
        f"(environment: torch 2.12.0 -> {torch.__version__}; git abc123 -> "
    )


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda raw: raw["config"].__setitem__(raw["config"].index("dim = 32"), "dim = 64"),
            "was recorded with another config: model.dim: 64 -> 32;",
        ),
        (
            lambda raw: raw["environment"].__setitem__("device", "cuda"),
            "was recorded on cuda, this run would be on cpu;",
        ),
        (
            lambda raw: raw.__setitem__("version", 3),
            "version 3 is not a smoke record version this goodput reads (1 or 2);",
        ),
        (
            lambda raw: raw.update(
                world_size=2,
                config=[line.replace("tp = 1", "tp = 2") for line in raw["config"]],
            ),
            "was recorded on 2 ranks (tp=2), this run would be on 2 ranks: another layout is "
            "compared with a one-process baseline only;",
        ),
    ],
    ids=["config", "device", "version", "layout"],
)
def test_a_baseline_of_another_config_or_device_is_a_usage_error(
    recorded, tmp_path, smoke_here, edit, expected
):
    config, record = recorded
    baseline = edited(record, tmp_path, edit)
    result = smoke_here(config, "--baseline", baseline)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"goodput: error: {baseline}: {expected}")
    assert "step=" not in result.stdout  # refused before the trainer ran


def test_another_step_count_or_override_is_a_usage_error(recorded, smoke_here):
    config, record = recorded
    result = smoke_here(config, "--steps", NUM_STEPS + 1, "--baseline", record)
    assert result.returncode == 2
    assert f"--steps: {NUM_STEPS + 1} differs from the {NUM_STEPS} steps of {record}" in (
        result.stderr
    )
    result = smoke_here(config, "schedule.lr=0.02", "--baseline", record)
    assert result.returncode == 2
    assert "another config: schedule.lr: 0.01 -> 0.02;" in result.stderr


def test_a_layout_the_trainer_would_refuse_is_a_usage_error_before_anything_runs(
    recorded, smoke_here
):
    config, record = recorded
    result = smoke_here(config, "parallel.tp=4", "--nproc", "2", "--baseline", record)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "tp = 4" in result.stderr and "step=" not in result.stdout


def compare(baseline, now, *, same_layout=True):
    return first_difference(
        baseline, now, metric_tolerances(baseline, now, same_layout=same_layout)
    )


def test_peak_memory_and_off_cpu_values_get_their_stated_tolerance(recorded):
    _, record = recorded
    baseline = read_record(record)

    def now(step, **changes):
        steps = list(baseline.steps)
        steps[step - 1] = dataclasses.replace(steps[step - 1], **changes)
        return dataclasses.replace(baseline, steps=tuple(steps))

    memory = baseline.steps[2].peak_memory_gib
    inside = memory * (1 + PEAK_MEMORY_TOLERANCE * 0.9)
    outside = memory * (1 + PEAK_MEMORY_TOLERANCE * 1.1)
    assert compare(baseline, now(3, peak_memory_gib=inside)) is None
    found = compare(baseline, now(3, peak_memory_gib=outside))
    assert found is not None and (found.step, found.metric, found.now) == (
        3,
        "peak_memory_gib",
        outside,
    )
    # A GPU baseline: kernels differ by version, so a stated relative tolerance, not bits.
    gpu = dataclasses.replace(baseline, environment={**baseline.environment, "device": "cuda"})
    loss = baseline.steps[1].loss
    assert compare(gpu, now(2, loss=loss * (1 + 1e-6))) is None
    found = compare(gpu, now(2, loss=loss * 1.01))
    assert found is not None and (found.step, found.metric) == (2, "loss")
    # On CPU the smallest change is a difference ...
    found = compare(baseline, now(2, loss=math.nextafter(loss, 0)))
    assert found is not None and (found.step, found.metric, found.tolerance) == (2, "loss", 0)
    # ... on the CPU model the baseline was recorded on; MKL's kernels differ on another.
    elsewhere = {**baseline.environment, "device_name": "Another CPU"}
    moved = dataclasses.replace(now(2, loss=loss * (1 + 1e-6)), environment=elsewhere)
    assert compare(baseline, moved) is None
    moved = dataclasses.replace(now(2, loss=loss * 1.01), environment=elsewhere)
    found = compare(baseline, moved)
    assert found is not None and (found.step, found.metric, found.tolerance) == (2, "loss", 1e-3)


def test_another_layout_gets_the_layouts_tolerance_and_no_memory_comparison(recorded):
    baseline = read_record(recorded[1])
    step = baseline.steps[1]

    def now(**changes):
        return dataclasses.replace(
            baseline,
            steps=(baseline.steps[0], dataclasses.replace(step, **changes), *baseline.steps[2:]),
        )

    # The drift of a layout's summation order passes; a rank's share of the memory is no change.
    drift = now(
        loss=step.loss * (1 + LAYOUT_TOLERANCE["loss"] / 2),
        grad_norm=step.grad_norm * (1 + LAYOUT_TOLERANCE["grad_norm"] / 2),
        peak_memory_gib=step.peak_memory_gib / 2,
    )
    assert compare(baseline, drift, same_layout=False) is None
    assert compare(baseline, drift) is not None  # in the baseline's own layout: bit for bit
    for metric, tolerance in LAYOUT_TOLERANCE.items():
        off = now(**{metric: getattr(step, metric) * (1 + 2 * tolerance)})
        found = compare(baseline, off, same_layout=False)
        assert found is not None and (found.step, found.metric, found.tolerance) == (
            2,
            metric,
            tolerance,
        )


def test_a_record_of_version_1_reads_as_one_process(recorded, tmp_path):
    def as_version_1(raw):  # as goodput wrote records before the smoke ran layouts
        raw["version"] = 1
        del raw["world_size"]

    old = read_record(edited(recorded[1], tmp_path, as_version_1))
    assert old == dataclasses.replace(read_record(recorded[1]), world_size=1)
    # A version 1 record with a world size is a record of neither version.
    with pytest.raises(GoodputError, match="has an unknown key 'world_size'"):
        read_record(edited(recorded[1], tmp_path, lambda raw: raw.update(version=1)))


def _valid(record: Path) -> dict:
    return json.loads(record.read_text())


HOSTILE = {
    "not JSON": lambda raw: b"{not json",
    "truncated": lambda raw: json.dumps(raw).encode()[:-30],
    "too big": lambda raw: b" " * (MAX_RECORD_BYTES + 1),
    "a list": lambda raw: b"[]",
    "another format": lambda raw: json.dumps({**raw, "format": "metrics"}).encode(),
    "a boolean version": lambda raw: json.dumps({**raw, "version": True}).encode(),
    "a missing key": lambda raw: json.dumps(
        {k: v for k, v in raw.items() if k != "steps"}
    ).encode(),
    "an unknown key": lambda raw: json.dumps({**raw, "extra": 1}).encode(),
    "no steps": lambda raw: json.dumps({**raw, "steps": []}).encode(),
    "a NaN loss": lambda raw: json.dumps(
        {**raw, "steps": [{**raw["steps"][0], "loss": math.nan}, *raw["steps"][1:]]}
    ).encode(),
    "an infinite grad_norm": lambda raw: json.dumps(
        {**raw, "steps": [{**raw["steps"][0], "grad_norm": 1e999}, *raw["steps"][1:]]}
    ).encode(),
    "a string loss": lambda raw: json.dumps(
        {**raw, "steps": [{**raw["steps"][0], "loss": "8.3"}, *raw["steps"][1:]]}
    ).encode(),
    "steps out of order": lambda raw: json.dumps({**raw, "steps": raw["steps"][::-1]}).encode(),
    "too many steps": lambda raw: json.dumps({**raw, "steps": raw["steps"] * 2000}).encode(),
    "a newline in the environment": lambda raw: json.dumps(
        {**raw, "environment": {**raw["environment"], "torch": "2.13\n\x1b[31m"}}
    ).encode(),
    "config not TOML": lambda raw: json.dumps({**raw, "config": ["[model", "dim ="]}).encode(),
    "config as one string": lambda raw: json.dumps({**raw, "config": "[model]"}).encode(),
    "no world size": lambda raw: json.dumps(
        {k: v for k, v in raw.items() if k != "world_size"}
    ).encode(),
    "a zero world size": lambda raw: json.dumps({**raw, "world_size": 0}).encode(),
    "a float world size": lambda raw: json.dumps({**raw, "world_size": 2.0}).encode(),
    "a boolean world size": lambda raw: json.dumps({**raw, "world_size": True}).encode(),
    "a huge world size": lambda raw: json.dumps({**raw, "world_size": 10**30}).encode(),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_baseline_is_one_line_naming_the_file(recorded, tmp_path, name):
    _, record = recorded
    baseline = tmp_path / "baseline.json"
    baseline.write_bytes(HOSTILE[name](_valid(record)))
    with pytest.raises(GoodputError) as caught:
        read_record(baseline)
    error = caught.value
    assert error.code == ExitCode.USAGE and error.where == str(baseline)
    assert "\n" not in error.render() and "\x1b" not in error.render()


def test_a_hostile_baseline_through_the_cli_is_one_line_and_exit_2(recorded, tmp_path):
    config, record = recorded
    baseline = tmp_path / "baseline.json"
    baseline.write_bytes(HOSTILE["a NaN loss"](_valid(record)))
    result = smoke(config, "--baseline", baseline)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"goodput: error: {baseline}: steps[0].loss is nan, not a")


def test_a_config_with_memory_snapshots_smokes_without_them(recorded, tmp_path, smoke_here):
    # The smoke's step times are the steps' alone: its overrides turn the snapshots off, so
    # nothing is ever written under the config's memory_dir.
    config, _ = recorded
    memory = tmp_path / "memory"
    memory.mkdir()
    record = tmp_path / "record.json"
    overrides = ["checkpoint.memory_interval_steps=1", f"checkpoint.memory_dir={memory}"]
    result = smoke_here(config, *overrides, "--steps", 2, "--record", record)
    assert result.returncode == 0, result.stderr
    assert "memory snapshots" not in result.stdout + result.stderr
    assert list(memory.iterdir()) == []
