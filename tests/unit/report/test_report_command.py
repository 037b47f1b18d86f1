"""``goodput report`` through its command line: the terminal summary, ``--json``, ``--html``,
``--watch`` following a run until it is done, and one-line refusals."""

import json
import subprocess
import sys
import time

import pytest

from goodput.cli import main
from goodput.testing.run_dirs import Attempt, write_run

T0 = 1_800_000_000.0
CRASH = Attempt(start=T0, startup_s=5, steps=range(1, 5), tail_s=2, class_="error",
                exit_code=1, job="7", wait_s=3)  # fmt: skip
RESUME = Attempt(start=T0 + 14, startup_s=4, steps=range(3, 9), job="7")


def test_the_summary_json_and_page(tmp_path, capsys):
    write_run(tmp_path / "run", [CRASH, RESUME], checkpoints=[2, 8], done=True)
    assert main(["report", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "where the wall time went" in out and "recomputed" in out
    assert main(["report", str(tmp_path / "run"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == {"kept": 8, "recomputed": 2, "last": 8, "done": True}
    assert [a["class"] for a in report["attempts"]] == ["error", "success"]
    assert report["productive_s"] == pytest.approx(8.0) and report["badput_s"]["backoff"] == 3
    page = tmp_path / "page.html"
    assert main(["report", str(tmp_path / "run"), "--html", str(page)]) == 0
    assert f"report: {page}" in capsys.readouterr().out and page.read_text().count("<img") >= 4


def test_watch_follows_the_run_until_it_is_done(tmp_path):
    write_run(tmp_path / "run", [CRASH], checkpoints=[2], done=False)
    watch = subprocess.Popen(
        [sys.executable, "-m", "goodput", "report", str(tmp_path / "run"), "--watch",
         "--every", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(2)
    assert watch.poll() is None  # still watching: the run is not done
    (tmp_path / "run" / "done").write_text("")
    out, err = watch.communicate(timeout=30)
    assert watch.returncode == 0, err
    assert "goodput" in out and "(done;" in out  # off a terminal: the last frame


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["report", "{tmp}/none"], "no such run directory"),
        (["report", "{tmp}"], "no run to report"),
        (["report", "{tmp}", "--watch", "--json"], "--watch"),
    ],
)
def test_refusals_are_one_line(tmp_path, capsys, args, message):
    code = main([arg.format(tmp=tmp_path) for arg in args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1
