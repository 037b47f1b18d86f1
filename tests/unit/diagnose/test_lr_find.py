"""``goodput diagnose lr-find`` through the real CLI on a tiny config: the ramp stops at the
cliff, its regions come in order with the suggestion in the basin, ``--json`` prints one JSON
object, ``--plot`` writes a PNG that decodes, and the run directory gets ``lr_find.json`` and
nothing else. Bad options are one usage line (exit 2) with nothing written; a run directory
the trainer would refuse is refused the same way. The docs' lr-find lines run as written."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import matplotlib.image
import pytest

from goodput.cli import main
from goodput.config import to_toml
from goodput.testing.jobs import REPO, outside_any_job
from goodput.testing.tiny import tiny_run_config

CURVE_KEYS = {"step", "lr", "loss", "smoothed_loss", "grad_norm"}
# A 40-step ramp, a tenth of the 200 the docs advise: Adam's second moment must keep up
# (beta2 0.9: ~10 steps, optim.md section 9) and nothing may hold the divergence back (no
# clipping, a short first moment), so that the cliff comes before the last step.
SHORT_RAMP = ["train.max_grad_norm=inf", "optim.betas=[0.5, 0.9]", "optim.weight_decay=0.0"]


def lr_find(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "goodput", "diagnose", "lr-find", *map(str, args)],
        capture_output=True,
        text=True,
        env=outside_any_job(OMP_NUM_THREADS="1"),
        timeout=300,
        cwd=cwd,
    )


def tiny_config(folder: Path) -> Path:
    cfg = tiny_run_config(folder)
    config = folder / "tiny.toml"
    config.write_text(to_toml(replace(cfg, train=replace(cfg.train, tensorboard=False))))
    return config


@pytest.fixture(scope="module")
def ramp(tmp_path_factory):
    """(folder, the --json result, the run's wall time) of one 40-step ramp, 1e-5 to 10."""
    folder = tmp_path_factory.mktemp("lr-find")
    config = tiny_config(folder)
    begin = time.perf_counter()
    result = lr_find(
        config, *SHORT_RAMP, "--steps", 40, "--min-lr", 1e-5, "--max-lr", 10,
        "--json", "--plot", folder / "lr.png",
    )  # fmt: skip
    seconds = time.perf_counter() - begin
    assert result.returncode == 0, result.stderr
    print(f"lr-find: 40-step tiny ramp took {seconds:.1f} s")
    return folder, json.loads(result.stdout), seconds


def test_json_is_one_object_with_the_documented_keys(ramp):
    _, found, _ = ramp
    assert set(found) == {
        "suggested_lr", "regions", "note", "steps_run", "stopped_early", "curve",
    }  # fmt: skip
    assert set(found["regions"]) == {"plateau", "basin", "cliff"}
    assert found["steps_run"] == len(found["curve"])
    for index, point in enumerate(found["curve"]):
        assert set(point) == CURVE_KEYS and point["step"] == index + 1
    lrs = [point["lr"] for point in found["curve"]]
    assert lrs[0] == 1e-5 and lrs == sorted(lrs)


def test_it_stops_early_at_the_cliff_with_ordered_regions(ramp):
    _, found, _ = ramp
    assert found["stopped_early"] and found["steps_run"] < 40
    plateau, basin, cliff = (found["regions"][name] for name in ("plateau", "basin", "cliff"))
    assert plateau and basin and cliff
    assert plateau[0] <= plateau[1] < basin[0] <= basin[1] < cliff[0] <= cliff[1]
    assert basin[0] <= found["suggested_lr"] <= basin[1]
    assert found["note"] is None
    # The smoothed loss fell in the basin: the model learned at those lrs.
    curve = found["curve"]
    assert min(p["smoothed_loss"] for p in curve if p["smoothed_loss"]) < curve[0]["loss"] - 0.1


def test_the_plot_is_a_png_that_decodes(ramp):
    folder, _, _ = ramp
    pixels = matplotlib.image.imread(folder / "lr.png")
    assert pixels.shape[0] > 0 and pixels.shape[1] > 0
    assert not list(folder.glob(".lr.png.*"))  # the temp file was renamed


def test_the_run_directory_gets_lr_find_json_and_nothing_else(ramp):
    folder, found, _ = ramp
    run_dir = folder / "run"
    assert sorted(p.name for p in run_dir.iterdir()) == ["lr_find.json"]
    written = json.loads((run_dir / "lr_find.json").read_text())
    assert written["ramp"] == {"steps": 40, "min_lr": 1e-5, "max_lr": 10.0}
    assert {key: value for key, value in written.items() if key != "ramp"} == found


def test_without_json_it_prints_progress_and_a_summary(tmp_path):
    result = lr_find(tiny_config(tmp_path), "--steps", 10, "--min-lr", 1e-4, "--max-lr", 1e-1)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    progress = [line for line in lines if re.match(r"lr-find: step \d+/10 lr ", line)]
    assert len(progress) == 10  # one a tenth of the steps
    assert any(line.startswith("lr-find: regions: plateau ") for line in lines)
    assert any(line.startswith("lr-find: suggested lr ") for line in lines)


@pytest.mark.parametrize(
    ("options", "names"),
    [
        (["--steps", "5"], "--steps"),
        (["--min-lr", "1", "--max-lr", "1"], "--min-lr"),
        (["--min-lr", "0"], "--min-lr"),
        (["--max-lr", "-1"], "--max-lr"),
        (["--max-lr", "nan"], "--max-lr"),
        (["--min-lr", "5e-324", "--max-lr", "10"], "--min-lr"),  # a ramp of infinite lrs
        (["--plot", "{tmp}/missing/lr.png"], "--plot"),
        (["--plot", "{tmp}/lr.jpg"], "--plot"),
    ],
)
def test_bad_options_are_one_usage_line_and_write_nothing(tmp_path, capsys, options, names):
    config = tiny_config(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    argv = ["diagnose", "lr-find", str(config), *(o.format(tmp=tmp_path) for o in options)]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own checks
        code = exit_.code
    assert code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and names in error
    assert sorted(tmp_path.rglob("*")) == before


def test_a_run_directory_the_trainer_refuses_is_refused(tmp_path):
    config = tiny_config(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    result = lr_find(config, "--steps", 10)
    assert result.returncode == 2
    assert "is not a goodput run directory" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]


def test_the_docs_lr_find_lines_run_as_written(tmp_path):
    """In a folder whose configs/tiny-cpu.toml is a tiny stand-in (the demo's model takes
    minutes for 200 steps on CI's two cores); every other word is the docs'."""
    lines = [line for line in _doc_lines() if line.startswith("goodput diagnose lr-find ")]
    assert lines
    (tmp_path / "configs").mkdir()
    cfg = tiny_run_config(tmp_path)
    cfg = replace(cfg, train=replace(cfg.train, run_dir="demo/run", tensorboard=False))
    (tmp_path / "configs" / "tiny-cpu.toml").write_text(to_toml(cfg))
    for line in lines:
        words = shlex.split(line)
        assert words[:3] == ["goodput", "diagnose", "lr-find"]
        result = lr_find(*words[3:], cwd=tmp_path)
        assert result.returncode == 0, f"{line}\n{result.stderr}"
        if "--json" in words:
            json.loads(result.stdout)
        if "--plot" in words:
            assert (tmp_path / words[words.index("--plot") + 1]).is_file()
    assert (tmp_path / "demo" / "run" / "lr_find.json").is_file()


def _doc_lines() -> list[str]:
    text = (REPO / "docs" / "diagnose.md").read_text()
    lines = []
    for body in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                lines.append(line.split(" # ")[0].strip())
    return lines
