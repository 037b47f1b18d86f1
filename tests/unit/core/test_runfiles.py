"""``goodput.runfiles``, the line schema of metrics.jsonl and evals.jsonl: what the trainer and
``goodput eval`` write reads back, field for field, through the schema and every reader; the
keys a reader requires are written every step; the line format holds to the byte; a damaged line
is one error naming FILE:LINE and the key; and no module but runfiles parses a run file."""

from __future__ import annotations

import ast
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from goodput import rundir, runfiles
from goodput.diagnose.batch_size import read_estimates
from goodput.diagnose.smoke_record import METRICS as SMOKE_METRICS
from goodput.errors import GoodputError
from goodput.eval.records import EvalRecord, append_evals
from goodput.report import run_files
from goodput.train.metrics import Metrics
from goodput.train.step import ExpertLoad, StepResult

PACKAGE = Path(runfiles.__file__).parent


def write_steps(run_dir: Path) -> list[dict]:
    """Two steps as the trainer writes them: a mixture of experts' with every measured key of
    the schema and a held-out eval, then a skipped one (its gradient norm infinite)."""
    metrics = Metrics(
        run_dir,
        rank=0,
        world_size=2,
        device=torch.device("cpu"),
        tokens_per_step=256,
        flops_per_token=1000,
        peak_flops_per_device=1e9,
        tensorboard=False,
    )
    measured = {
        "gns": 1234.5,
        "loss_z": None,
        "startup_s": 3.0,
        "data_time_s": 0.01,
        "checkpoint_stall_s": 0.02,
        "checkpoint_load_s": 1.5,
        "snapshot_stall_s": 0.04,
        "resumed_from": "partner",
        "resumed_step": 120,
        "eval_time_s": 0.3,
        "heldout_loss/code": 2.25,
        "busy_s_min": 0.1,
        "busy_s_median": 0.11,
        "busy_s_max": 0.2,
        "busy_slowest_rank": 1,
        "busy_slowest_host": "nid0001",
        "straggler_rank": 1,
        "straggler_ratio": 1.62,
    }
    load = ExpertLoad(imbalance=1.5, dropped_tokens=7)
    records = [
        metrics.step(
            1,
            StepResult(2.5, 0.5, 256, expert_load=load),
            1e-3,
            0.5,
            0,
            measured,
            stage=0,
            tokens=256,
        ),
        metrics.step(
            2, StepResult(2.0, math.inf, 256, skipped=True), 2e-3, 0.25, 1, stage=1, tokens=512
        ),
    ]
    metrics.close()
    return records


def test_what_the_trainer_writes_reads_back_field_for_field(tmp_path, capsys):
    records = write_steps(tmp_path)
    lines = list(runfiles.read_steps(tmp_path / rundir.METRICS, require=runfiles.RECORD_KEYS))
    assert [line.step for line in lines] == [1, 2]
    for record, line in zip(records, lines, strict=True):
        assert dict(line.raw) == runfiles.nonfinite_as_null(record)
        assert list(line.raw) == list(record)  # in the order written
    assert runfiles.MEASURED.keys() <= lines[0].raw.keys()  # every measured key, tested
    assert lines[1].raw["grad_norm"] is None and lines[1].number("grad_norm") is None
    # The readers: the report's steps, diagnose batch-size's estimates.
    steps = run_files.read_run(tmp_path).steps
    assert (steps[0].startup_s, steps[0].eval_time_s, steps[1].startup_s) == (3.0, 0.3, None)
    assert steps[0].tokens == 256 and steps[1].tokens == 256  # tokens/s x step time
    assert steps[0].values["expert_load_imbalance"] == 1.5 and "grad_norm" not in steps[1].values
    assert read_estimates(tmp_path / rundir.METRICS).by_step == {1: 1234.5}


def test_what_goodput_eval_writes_reads_back(tmp_path):
    written = [EvalRecord("heldout/code", "loss", 2), EvalRecord("arc", "acc", math.nan, 0.01)]
    append_evals(tmp_path, 40, written, source="goodput eval")
    read = list(runfiles.read_evals(tmp_path / rundir.EVALS))
    assert [(e.step, e.task, e.metric, e.value, e.stderr, e.source) for e in read] == [
        (40, "heldout/code", "loss", 2.0, None, "goodput eval"),
        (40, "arc", "acc", None, 0.01, "goodput eval"),
    ]
    assert read[0].time is not None and read[0].time == read[1].time  # one evaluation, one time


@pytest.mark.parametrize(
    "required", [run_files.REQUIRED, SMOKE_METRICS, ("loss",)], ids=["report", "smoke", "demo"]
)
def test_every_key_a_reader_requires_is_written_every_step(required):
    assert set(required) <= set(runfiles.RECORD_KEYS)


def test_the_line_format_holds_to_the_byte():
    # What every goodput so far has written, and what other tools (jq, pandas) read: this order,
    # compact separators, a non-finite number as null.
    record = runfiles.StepRecord(
        step=3, loss=math.nan, grad_norm=0.5, lr=0.001, tokens_per_s=100.0,
        tokens_per_s_per_device=50.0, mfu=None, peak_memory_gib=1.5, step_time_s=2.0,
        skipped=False, skipped_steps=0, time=1700000000.5, stage=1, tokens=768,
        measured={"gns": 7, "x/y": None},
    )  # fmt: skip
    line = runfiles.json_line(runfiles.nonfinite_as_null(record.as_json()), where="test")
    assert line == (
        '{"step": 3, "loss": null, "grad_norm": 0.5, "lr": 0.001, "tokens_per_s": 100.0, '
        '"tokens_per_s_per_device": 50.0, "mfu": null, "peak_memory_gib": 1.5, "step_time_s": '
        '2.0, "skipped": false, "skipped_steps": 0, "time": 1700000000.5, "stage": 1, '
        '"tokens": 768, "gns": 7, "x/y": null}\n'
    )


GOOD = '{"step": 1, "loss": 2.0, "step_time_s": 1.0, "time": 5.0}'


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ('{"loss": 2.0}', "'step' is missing, not a whole number >= 0"),
        ('{"step": true}', "'step' is true, not a whole number >= 0"),
        ('{"step": 4611686018427387904}', "'step' is 4611686018427387904"),
        ('{"step": 1, "loss": "2"}', "'loss' is \"2\", not a finite number or null"),
        ('{"step": 1, "loss": 1' + "0" * 400 + "}", "not a finite number or null"),
        ('{"step": 1, "lr": -1}', "'lr' is -1, not a finite number >= 0 or null"),
        ('{"step": 1, "time": null}', "'time' is null, not a finite number >= 0"),
        ('{"step": 1, "skipped": 0}', "'skipped' is 0, not true or false"),
        ('{"step": 1, "gns": [1]}', "'gns' is an array, not a number or null"),
        ('{"step": 1, "step_time_s": 1e999}', "'step_time_s' is Infinity"),
        ('{"step": 1, "data_time_s": {}}', "'data_time_s' is an object"),
    ],
)
def test_a_damaged_step_line_is_one_error_naming_it(tmp_path, line, what):
    path = tmp_path / rundir.METRICS
    path.write_text(f"{GOOD}\n{line}\n")
    with pytest.raises(GoodputError) as error:
        list(runfiles.read_steps(path))
    rendered = error.value.render()
    assert rendered.startswith(f"{path}:2: ") and what in rendered and "\n" not in rendered


def test_unknown_keys_pass_a_torn_line_is_left_out_and_required_keys_are_asked(tmp_path):
    path = tmp_path / rundir.METRICS
    path.write_text(f'{{"step": 1, "acc/arc": "any", "loss_z": [1]}}\n\n{GOOD}\n{{"step": 3')
    lines = list(runfiles.read_steps(path))
    assert [(line.step, line.line) for line in lines] == [(1, 1), (1, 3)]
    assert lines[1].numbers() == {"step": 1.0, "loss": 2.0, "step_time_s": 1.0, "time": 5.0}
    with pytest.raises(GoodputError, match="'grad_norm' is missing"):
        list(runfiles.read_steps(path, require=["grad_norm"]))


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"task": ""}, "'task' is \"\", not a name"),
        ({"metric": 3}, "'metric' is 3, not a name"),
        ({"source": None}, "'source' is null, not a name"),
        ({"value": "1"}, "'value' is \"1\", not a finite number or null"),
        ({"stderr": True}, "'stderr' is true"),
        ({"stderr": -0.1}, "'stderr' is -0.1, not a finite number >= 0 or null"),
        ({"step": -2}, "'step' is -2"),
        ({"time": -1.0}, "'time' is -1.0, not a finite number >= 0"),
    ],
)
def test_a_damaged_eval_line_is_one_error_naming_it(tmp_path, change, what):
    good = {"step": 1, "task": "arc", "metric": "acc", "value": 0.5, "stderr": None, "source": "x"}
    path = tmp_path / rundir.EVALS
    path.write_text(json.dumps(good) + "\n" + json.dumps(good | change) + "\n")
    with pytest.raises(GoodputError) as error:
        list(runfiles.read_evals(path))
    assert error.value.render().startswith(f"{path}:2: ") and what in error.value.render()


GOOD_BUSY = {
    "step": 40,
    "steps": 20,
    "ranks": 24,
    "quantiles": [0.1, 0.12, 0.13, 0.14, 0.3],
    "slowest": [[7, "nid0001", 0.3], [19, "nid0002", 0.2], [3, "nid0000", 0.2]],
}


def test_a_busy_line_reads_back_as_written(tmp_path):
    path = tmp_path / rundir.BUSY
    path.write_text(runfiles.json_line(GOOD_BUSY, where=path))
    (line,) = runfiles.read_busy(path)
    assert line == runfiles.BusyLine(
        step=40, steps=20, ranks=24, quantiles=(0.1, 0.12, 0.13, 0.14, 0.3),
        slowest=(runfiles.RankBusy(7, "nid0001", 0.3), runfiles.RankBusy(19, "nid0002", 0.2),
                 runfiles.RankBusy(3, "nid0000", 0.2)),
    )  # fmt: skip
    assert line.as_json() == GOOD_BUSY


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"ranks": 0}, "'ranks' is 0, not a whole number >= 1"),
        ({"quantiles": [0.1, 0.12, 0.13, 0.3]}, "'quantiles' is not [min, p25, median, p75, max]"),
        ({"quantiles": [0.1, 0.14, 0.13, 0.14, 0.3]}, "nondecreasing"),
        ({"quantiles": [-0.1, 0.12, 0.13, 0.14, 0.3]}, "finite seconds >= 0"),
        ({"quantiles": [0.1, 0.12, 0.13, 0.14, 1e309]}, "not a JSON line"),  # Infinity
        ({"slowest": []}, "'slowest' does not name 1 to 8 ranks"),
        ({"slowest": [[i, "nid0", 0.3] for i in range(9)]}, "does not name 1 to 8 ranks"),
        ({"ranks": 2}, "'slowest' does not name 1 to 2 ranks"),
        ({"slowest": [[24, "nid0", 0.3]]}, "slowest[0]: is not [rank, host, mean_s]: a rank below"),
        ({"slowest": [[1, "", 0.3]]}, "slowest[0]: is not [rank, host, mean_s]"),
        ({"slowest": [[1, "nid0", 0.3], [2, "nid0", 0.05]]}, "mean_s 0.05 is not within the"),
        ({"slowest": [[1, "nid0", 0.3], [2, "nid0", 0.31]]}, "mean_s 0.31 is not within"),
        ({"slowest": [[1, "nid0", 0.3], [1, "nid1", 0.2]]}, "'slowest' names a rank twice"),
        ({"slowest": [[1, "nid0", 0.3], [2, "nid0", 0.2], [3, "nid0", 0.25]]}, "not slowest first"),
        ({"slowest": [[1, "nid0", 0.2]]}, "slowest[0]'s mean_s 0.2 is not the max 0.3"),
        ({"extra": 1}, "has keys other than step, steps, ranks, quantiles, slowest"),
    ],
)  # fmt: skip
def test_a_damaged_busy_line_is_one_error_naming_it(tmp_path, change, what):
    path = tmp_path / rundir.BUSY
    text = json.dumps(GOOD_BUSY) + "\n" + json.dumps(GOOD_BUSY | change) + "\n"
    path.write_text(text.replace("1e+309", "Infinity"))
    with pytest.raises(GoodputError) as error:
        list(runfiles.read_busy(path))
    rendered = error.value.render()
    assert rendered.startswith(f"{path}:2: ") and what in rendered
    assert "\n" not in rendered


def test_an_older_goodputs_busy_line_names_its_line_and_how_to_keep_the_newer_ones(tmp_path):
    """A run upgraded mid-way holds both shapes: the old one (a row per host) has no ranks to
    name, so it is refused, with the command that keeps the new lines."""
    path = tmp_path / rundir.BUSY
    old = {"step": 20, "steps": 20, "hosts": [["nid0000", 0.13, 0.12, 0.14]]}
    path.write_text(json.dumps(old) + "\n" + json.dumps(GOOD_BUSY) + "\n")
    with pytest.raises(GoodputError) as error:
        list(runfiles.read_busy(path))
    rendered = error.value.render()
    assert rendered.startswith(f"{path}:1: is a busy line of an older goodput, a row per host; ")
    # The fix, run as it says in the run directory, leaves a file that reads.
    command = rendered.partition("in the run directory, ")[2]
    subprocess.run(["sh", "-c", command], cwd=tmp_path, check=True)
    assert [line.step for line in runfiles.read_busy(path)] == [40]


def test_no_module_but_runfiles_parses_a_run_file():
    """A module that names metrics.jsonl or evals.jsonl (``rundir.METRICS``, ``rundir.EVALS``)
    calls no JSON parser of its own, and no code spells them as a path: rundir names the files,
    runfiles reads them. (Help and doc text may mention them.)"""
    parsers = {"json.loads", "read_json_lines", "json_object"}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("runfiles.py", "rundir.py", "io.py"):
            continue
        tree = ast.parse(path.read_text())
        nodes = list(ast.walk(tree))
        spelled = [
            node.lineno
            for node in nodes
            if isinstance(node, ast.Constant) and node.value in (rundir.METRICS, rundir.EVALS)
        ]
        names = {node.attr for node in nodes if isinstance(node, ast.Attribute)}
        called = {ast.unparse(node.func) for node in nodes if isinstance(node, ast.Call)}
        if spelled or ({"METRICS", "EVALS"} & names and parsers & called):
            offenders.append(f"{path.relative_to(PACKAGE)}: {spelled or sorted(parsers & called)}")
    assert offenders == [], offenders
