"""The one guard of every output path (``goodput.outputs``): each rule on its own, then every
command's output options through the real command line, onto the files they must never replace
(exit 2, one line naming the option, the target's bytes unchanged)."""

import os
import subprocess
from pathlib import Path

import pytest

from goodput import rundir
from goodput.errors import ExitCode, GoodputError
from goodput.outputs import (
    HTML_GENERATOR,
    HTML_REPORT,
    LAUNCH_DIR,
    LAUNCH_LOG,
    NEW_DIR,
    PNG_PLOT,
    RUN_DIR,
    SMOKE_RECORD,
    TORCH_FILE,
    check_output_dir,
    check_output_file,
    folder_holding,
)
from goodput.testing.jobs import run_goodput
from goodput.testing.run_dirs import Attempt, write_run

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.toml"
T0 = 1_800_000_000.0


def refused(call, *args, match: str = "") -> str:
    with pytest.raises(GoodputError, match=match) as exc:
        call(*args)
    assert exc.value.code == ExitCode.USAGE
    line = exc.value.render()
    assert "\n" not in line
    return line


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run directory with its metrics, attempts, config and two complete checkpoints."""
    run_dir = tmp_path / "run"
    write_run(run_dir, [Attempt(start=T0, startup_s=1, steps=range(1, 5))], checkpoints=[2, 4],
              done=True)  # fmt: skip
    (run_dir / rundir.CONFIG).write_text(CONFIG.read_text())
    step = rundir.step_dir(rundir.checkpoints_dir(run_dir), 4)
    (step / rundir.TRAIN_STATE).write_text('{"step": 4}\n')
    return run_dir


def test_writability_shapes(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    assert check_output_dir(tmp_path / "new" / "deeper", NEW_DIR, "--output") == (
        tmp_path / "new" / "deeper"
    )
    for path, message in ((file, "is a file where a folder"), (file / "sub", "file is a file")):
        line = refused(check_output_dir, path, NEW_DIR, "--output", match=message)
        assert line.startswith(f"--output {path}: ")
    refused(check_output_file, tmp_path, HTML_REPORT, "--html", match="is a folder, not a file")
    refused(check_output_file, file / "a.html", HTML_REPORT, "--html", match="where a folder")


def test_nothing_inside_a_run_or_a_checkpoint(run, tmp_path):
    step = rundir.step_dir(rundir.checkpoints_dir(run), 4)
    for path in (run / rundir.METRICS, run / "new.html", run / "checkpoints" / "x.html",
                 step / rundir.TRAIN_STATE, step / "new.html"):  # fmt: skip
        line = refused(check_output_file, path, HTML_REPORT, "--html", match="lies in the")
        assert line.startswith(f"--html {path}: ")
    # Through a symbolic link to it, or one to the folder it is in.
    (tmp_path / "link.html").symlink_to(run / rundir.METRICS)
    (tmp_path / "run-link").symlink_to(run)
    for path in (tmp_path / "link.html", tmp_path / "run-link" / "x.html"):
        refused(check_output_file, path, HTML_REPORT, "--html", match="lies in the run directory")
    # A hard link outside the run is the run's file under another name.
    os.link(run / rundir.METRICS, tmp_path / "hard.html")
    refused(check_output_file, tmp_path / "hard.html", HTML_REPORT, "--html", match="hard links")
    # A folder with only DCP's metadata, or only the completion marker, is a checkpoint.
    for marker in (rundir.METADATA, rundir.COMPLETE):
        folder = tmp_path / marker.strip(".")
        folder.mkdir()
        (folder / marker).write_bytes(b"")
        refused(check_output_dir, folder / "out", NEW_DIR, "--output", match="checkpoint")


def test_what_a_run_holds_of_its_own_kind_is_allowed(run, tmp_path):
    (run / rundir.RUN_RECORD).write_text("{}")
    assert check_output_dir(run, RUN_DIR, "train.run_dir") == run
    assert check_output_dir(run, LAUNCH_DIR, "--run-dir") == run
    assert check_output_file(run / "launch.log", LAUNCH_LOG, "--log")
    assert check_output_file(run / "job-12.out", LAUNCH_LOG, "--log")
    refused(check_output_file, run / "metrics.jsonl", LAUNCH_LOG, "--log", match="lies in")
    refused(check_output_file, run / "checkpoints" / "a.log", LAUNCH_LOG, "--log", match="lies in")
    refused(check_output_dir, run / "nested", RUN_DIR, "train.run_dir", match="lies in the run")
    refused(check_output_dir, run / "checkpoints", LAUNCH_DIR, "--run-dir", match="checkpoint")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    refused(check_output_dir, mine, RUN_DIR, "OUT_DIR", match="holds 'notes.txt'")
    (mine / "notes.txt").unlink()
    (mine / "attempts.log").write_text("")
    assert check_output_dir(mine, RUN_DIR, "OUT_DIR") == mine  # what goodput launch left


def test_a_launch_folder_may_hold_the_run(tmp_path):
    # goodput launch --log train.log: its run folder is the log's (here tmp_path), where it puts
    # attempts.jsonl and the heartbeat; the trainer's run directory may still lie in it.
    for name in (rundir.ATTEMPTS, rundir.HEARTBEAT, "train.log"):
        (tmp_path / name).write_text("{}\n")
    assert check_output_dir(tmp_path / "run", RUN_DIR, "train.run_dir") == tmp_path / "run"
    refused(check_output_file, tmp_path / rundir.ATTEMPTS, LAUNCH_LOG, "--log", match="not a log")


def test_an_existing_file_must_be_of_the_kind(tmp_path):
    page, plot, other = tmp_path / "a.html", tmp_path / "a.png", tmp_path / "notes.html"
    page.write_text(f"<!DOCTYPE html>\n<html><head>{HTML_GENERATOR}</head></html>\n")
    other.write_text("<!DOCTYPE html>\n<html>someone's page</html>\n")
    assert check_output_file(page, HTML_REPORT, "--html") == page
    refused(check_output_file, other, HTML_REPORT, "--html", match="is not a goodput report page")
    plot.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)  # a PNG goodput did not draw
    refused(check_output_file, plot, PNG_PLOT, "--plot", match="is not a PNG plot goodput drew")
    record = tmp_path / "smoke.json"
    record.write_text('{"format": "goodput-smoke"}')
    assert check_output_file(record, SMOKE_RECORD, "--record") == record
    record.write_text('{"format": "something else"}')
    refused(check_output_file, record, SMOKE_RECORD, "--record", match="not a smoke record")
    refused(check_output_file, record, TORCH_FILE, "FILE", match="smoke.json: exists; remove")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert check_output_file(empty, TORCH_FILE, "FILE") == empty  # nothing in it to lose
    os.mkfifo(tmp_path / "fifo.html")
    refused(check_output_file, tmp_path / "fifo.html", HTML_REPORT, "--html", match="regular")


def test_never_an_input_or_inside_one(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[model]\n")
    (tmp_path / "alias.json").symlink_to(config)
    for path in (config, tmp_path / "alias.json"):
        refused(check_output_file, path, SMOKE_RECORD, "--record", [config], match="also reads")
    source = tmp_path / "source"
    source.mkdir()
    refused(check_output_dir, source / "copy", NEW_DIR, "--dest", [source], match="also reads")


def test_a_folder_of_its_kind_or_new_or_empty(tmp_path):
    kind = folder_holding("campaign.json")
    out = tmp_path / "out"
    out.mkdir()
    assert check_output_dir(out, kind, "--output") == out
    (out / "notes.txt").write_text("keep")
    refused(check_output_dir, out, kind, "--output", match="is not a folder that holds")
    (out / "campaign.json").write_text("{}")
    assert check_output_dir(out, kind, "--output") == out
    refused(check_output_dir, out, NEW_DIR, "OUT_DIR", match="is not empty")


# Through the command line, as a user meets it.


def goodput(*argv: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_goodput(*argv, cwd=cwd, env={"GOODPUT_DEBUG": "0"})


def assert_refused(result: subprocess.CompletedProcess[str], option: str, target: Path,
                   before: bytes) -> None:  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"goodput: error: {option}"), lines
    assert "Traceback" not in result.stderr
    assert target.read_bytes() == before


def test_report_html_never_replaces_a_file_of_the_run(run):
    step = rundir.step_dir(rundir.checkpoints_dir(run), 4)
    for target in (run / rundir.METRICS, step / rundir.TRAIN_STATE, run / rundir.CONFIG):
        before = target.read_bytes()
        assert_refused(goodput("report", run, "--html", target), "--html", target, before)


def test_report_html_rewrites_its_own_page(run, tmp_path):
    page = tmp_path / "page.html"
    for _ in range(2):
        result = goodput("report", run, "--html", page)
        assert result.returncode == 0, result.stderr
    assert HTML_GENERATOR in page.read_text()
    notes = tmp_path / "notes.html"
    notes.write_text("<html>mine</html>")
    assert_refused(goodput("report", run, "--html", notes), "--html", notes, b"<html>mine</html>")


def test_lr_find_plot_never_replaces_the_config_or_another_file(tmp_path):
    config, png_config = tmp_path / "run.toml", tmp_path / "run.png"
    config.write_bytes(CONFIG.read_bytes())
    png_config.write_bytes(CONFIG.read_bytes())  # the config itself, whatever its name
    run_dir = f"train.run_dir={tmp_path / 'lr-run'}"
    not_a_plot = tmp_path / "notes.png"
    not_a_plot.write_text("not a plot")
    for read, target in ((config, config), (png_config, png_config), (config, not_a_plot)):
        before = target.read_bytes()
        result = goodput("diagnose", "lr-find", read, run_dir, "--plot", target)
        assert_refused(result, "--plot", target, before)
    assert not (tmp_path / "lr-run").exists()


def test_smoke_record_never_replaces_a_metrics_file(run):
    target = run / rundir.METRICS
    before = target.read_bytes()
    result = goodput("diagnose", "smoke", CONFIG, "--record", target)
    assert_refused(result, "--record", target, before)


def test_to_torch_never_replaces_another_file(run, tmp_path):
    target = tmp_path / "weights.pt"
    target.write_text("someone's notes")
    step = rundir.step_dir(rundir.checkpoints_dir(run), 4)
    result = goodput("ckpt", "to-torch", step, target)
    assert_refused(result, "FILE", target, b"someone's notes")


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        ("eval {run} --tasks x --output {run}/metrics.jsonl", "--output"),
        ("eval {run} --tasks x --samples {run}/config.toml", "--samples"),
        ("launch --log {run}/metrics.jsonl -- true", "--log"),
        ("launch --run-dir {step} -- true", "--run-dir"),
        (
            "submit --run-dir {step} --nhosts 1 --time 1:00:00 -- goodput launch -- true",
            "--run-dir",
        ),
        ("broadcast {tmp} --hosts a --dest {run}/copy --transport local", "--dest"),
        ("ckpt export-hf {step} {run}/hf", "OUT_DIR"),
        ("ckpt from-torch {tmp}/w.pt {run}/config.toml {step}", "OUT_DIR"),
        ("data demo-corpus --output {step}/corpus", "--output"),
        (
            "data tokenize {tmp}/in.jsonl --tokenizer {tmp}/t.model --output {run}/shards",
            "--output",
        ),
        (
            "data train-tokenizer {tmp}/in.jsonl --vocab-size 300 --output {run}/config.toml",
            "--output",
        ),
    ],
)
def test_every_output_option_refuses_a_run_before_any_work(run, tmp_path, capsys, argv, option):
    from goodput.cli import main

    step = rundir.step_dir(rundir.checkpoints_dir(run), 4)
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    places = {"run": run, "step": step, "tmp": tmp_path}
    assert main([word.format(**places) for word in argv.split()]) == ExitCode.USAGE
    lines = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in lines if not line.startswith("launch: ")]  # its plan, first
    assert len(lines) == 1 and lines[0].startswith(f"goodput: error: {option} "), lines
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
