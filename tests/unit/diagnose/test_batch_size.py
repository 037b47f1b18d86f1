"""``goodput diagnose batch-size`` on synthetic run directories with known gns series: the
hand-computed first/median/last, ratio, efficiencies and windows; what the ratio implies; the
strict reading of hostile input (broken lines named by number, a torn last line skipped,
non-object JSON, NaN, huge lines, a missing or broken config) and the docs' lines as written."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest

from goodput import rundir
from goodput.cli import main
from goodput.diagnose.batch_size import read_estimates, report, windows
from goodput.errors import ExitCode, GoodputError
from goodput.testing.fuzz import strict_json
from goodput.testing.jobs import REPO

DOC_SERIES = [1000, 2000, 4000, 6000, 7000, 8000, 8000, 8000]


def make_run(folder: Path, gns: list, tokens_per_step: int = 4096, extra: str = "") -> Path:
    """A run directory: config.toml and one metrics line per step, gns as given (None: null,
    "absent": no key)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(
        f'[train]\nsteps = 100\ntokens_per_step = {tokens_per_step}\nrun_dir = "{folder}"\n'
    )
    lines = []
    for step, value in enumerate(gns, start=1):
        entry = {"step": step, "loss": 4.0, "grad_norm": 1.0, "lr": 1e-3}
        if value != "absent":
            entry["gns"] = value
        lines.append(json.dumps(entry))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n" + extra)
    return folder


def test_a_known_series(tmp_path):
    # 12 estimates after 4 steps without: last quarter = the last 3: 900, 1100, 1000 -> 1000
    gns = [None, None, "absent", None, 100, 200, 300, 400, 500, 600, 700, 800, 850, 900, 1100, 1000]
    found = report(make_run(tmp_path / "run", gns, tokens_per_step=250))
    assert (found.first, found.median_last_quarter, found.last) == (100, 1000, 1000)
    assert found.steps_with_estimate == 12 and found.ignored_estimates == 0
    assert found.ratio == 0.25
    assert found.step_efficiency == pytest.approx(0.2)  # 1 / (1 + 4)
    assert found.data_efficiency == pytest.approx(0.8)  # 1 / (1 + 0.25)
    assert found.recommended_tokens == (500, 2000)
    assert "well below the noise scale" in found.verdict()
    # 12 estimates in 8 windows: bounds round(i * 1.5) = 0 2 3 4 6 8 9 10 12
    assert [(w.first_step, w.last_step, w.num_estimates) for w in found.windows] == [
        (5, 6, 2), (7, 7, 1), (8, 8, 1), (9, 10, 2), (11, 12, 2), (13, 13, 1), (14, 14, 1),
        (15, 16, 2),
    ]  # fmt: skip
    assert found.windows[0].median_gns == 150 and found.windows[-1].median_gns == 1050


def test_a_batch_far_above_the_noise_scale_has_diminishing_returns(tmp_path):
    found = report(make_run(tmp_path / "run", [1000.0] * 8, tokens_per_step=8000))
    assert found.ratio == 8
    assert found.data_efficiency == pytest.approx(1 / 9)
    verdict = found.verdict()
    # steps at 8000 over steps at 16000: (1 + 1/8) / (1 + 1/16) = 1.0588
    assert "well above the noise scale" in verdict and "1.06x" in verdict and "9.00x" in verdict


def test_estimates_no_batch_could_be_are_ignored_and_the_json_is_strict(tmp_path, capsys):
    # A subnormal B_simple made B/B_simple Infinity; one near float's limit, 2 B_simple.
    run = make_run(tmp_path / "run", [5e-324, 1e-17, 100.0, 1e300, 2.0**54, 300.0])
    found = report(run)
    assert found.ignored_estimates == 4 and found.steps_with_estimate == 2
    assert main(["diagnose", "batch-size", str(run), "--json"]) == 0
    printed = strict_json(capsys.readouterr().out)
    assert printed["ratio"] == 4096 / 300 and printed["recommended_tokens"] == [150.0, 600.0]


def test_unusable_estimates_are_ignored_and_counted(tmp_path):
    run = make_run(tmp_path / "run", [-5.0, 0.0, 100.0, 300.0], extra='{"step": 5, "gns": 1e999}\n')
    found = report(run)
    assert found.ignored_estimates == 3 and found.steps_with_estimate == 2
    assert found.median_last_quarter == 300


def test_a_repeated_step_keeps_its_later_line(tmp_path):
    run = make_run(tmp_path / "run", [100.0, 200.0], extra='{"step": 2, "gns": 400.0}\n')
    assert report(run).last == 400


def test_a_torn_last_line_is_skipped(tmp_path):
    run = make_run(tmp_path / "run", [100.0, 200.0], extra='{"step": 3, "gns": 30')
    assert report(run).steps_with_estimate == 2


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("[1, 2]", "not a JSON object"),
        ('"step"', "not a JSON object"),
        ('{"step": 3, "gns": NaN}', "NaN is not JSON"),
        ("{broken", "not valid JSON"),
        ('{"step": 3, "gns": "NaN"}', "'gns' is \"NaN\""),
        ('{"step": "3", "gns": 1.0}', "'step' is \"3\""),
        ('{"step": true, "gns": 1.0}', "'step' is true"),
        ('{"gns": 1.0}', "'step' is missing"),
        ('{"step": -1, "gns": 1.0}', "'step' is -1"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"step": 1' + "0" * 5000 + "}", "not valid JSON"),
        ('{"step": 3, "pad": "' + "x" * rundir.MAX_LINE_BYTES + '"}', "longer than"),
    ],
    ids=lambda v: v[:30] if isinstance(v, str) else v,
)
def test_a_broken_line_names_the_file_and_line(tmp_path, line, what):
    run = make_run(tmp_path / "run", [100.0, 200.0], extra=line + "\n" + '{"step": 4}\n')
    with pytest.raises(GoodputError) as error:
        report(run)
    rendered = error.value.render()
    assert "metrics.jsonl:3: " in rendered and what in rendered
    assert "\n" not in rendered and len(rendered) < 500
    assert error.value.code == ExitCode.USAGE


def test_a_run_without_an_estimate_says_why(tmp_path):
    run = make_run(tmp_path / "run", [None, "absent", None])
    with pytest.raises(GoodputError) as error:
        report(run)
    message = error.value.render()
    assert "no gradient-noise-scale estimate" in message and "single data-parallel rank" in message
    assert "2 or more data-parallel ranks" in message and error.value.code == ExitCode.ERROR


@pytest.mark.parametrize(
    ("config", "what"),
    [
        (None, "config.toml"),
        ("[train\n", "invalid TOML"),
        ("[model]\ndim = 8\n", "tokens_per_step is None"),
        ("[train]\ntokens_per_step = 0\n", "tokens_per_step is 0"),
        ('[train]\ntokens_per_step = "4096"\n', "tokens_per_step is '4096'"),
        ("[train]\ntokens_per_step = true\n", "tokens_per_step is True"),
        ("train = 3\n", "tokens_per_step is None"),
        ("[train]\ntokens_per_step = 9007199254740993\n", "not a whole number in [1, 2**53]"),
    ],
)
def test_a_missing_or_broken_config_is_named(tmp_path, config, what):
    run = make_run(tmp_path / "run", [100.0])
    if config is None:
        (run / "config.toml").unlink()
    else:
        (run / "config.toml").write_text(config)
    with pytest.raises(GoodputError) as error:
        report(run)
    assert "config.toml" in error.value.render() and what in error.value.render()
    assert error.value.code == ExitCode.USAGE


def test_missing_metrics_and_a_file_for_a_run_directory(tmp_path):
    run = make_run(tmp_path / "run", [100.0])
    (run / "metrics.jsonl").unlink()
    with pytest.raises(GoodputError, match="metrics.jsonl"):
        report(run)
    with pytest.raises(GoodputError, match="is not a folder"):
        report(run / "config.toml")


def test_windows_of_fewer_estimates_than_windows():
    assert [(w.first_step, w.median_gns) for w in windows([3, 9], [1.0, 5.0])] == [
        (3, 1.0),
        (9, 5.0),
    ]


def test_read_estimates_is_sorted_by_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 5, "gns": 5}\n\n{"step": 2, "gns": 2}\n')
    estimates = read_estimates(path)
    assert list(estimates.by_step.items()) == [(2, 2.0), (5, 5.0)] and estimates.num_lines == 2


def test_the_docs_batch_size_lines_run_as_written(tmp_path, capsys, monkeypatch):
    """On a run directory holding the series of the docs' example, whose figures they show."""
    make_run(tmp_path / "demo" / "run", DOC_SERIES)
    monkeypatch.chdir(tmp_path)
    text = (REPO / "docs" / "diagnose.md").read_text()
    lines = [
        line.strip()
        for body in re.findall(r"```sh\n(.*?)```", text, re.S)
        for line in body.splitlines()
        if line.strip().startswith("goodput diagnose batch-size")
    ]
    assert len(lines) == 2
    for line in lines:
        assert main(shlex.split(line)[1:]) == 0
        out = capsys.readouterr().out
        if "--json" in line:
            found = json.loads(out)
            assert found["b_simple_tokens"] == {
                "first": 1000.0, "median_last_quarter": 8000.0, "last": 8000.0,
            }  # fmt: skip
            assert found["ratio"] == 0.512 and found["recommended_tokens"] == [4000.0, 16000.0]
            assert round(found["step_efficiency"], 4) == 0.3386
            assert round(found["data_efficiency"], 4) == 0.6614
            assert found["steps_with_estimate"] == 8 and len(found["windows"]) == 8
            assert math.isclose(found["step_efficiency"] + found["data_efficiency"], 1)
        else:
            shown = out.splitlines()
            for expected in (shown[0], shown[-3], shown[-2], shown[-1]):
                assert expected in text  # the docs' example output is the real output
