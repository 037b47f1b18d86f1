"""Files that are not files, and lines that are not lines, where the user meets them: a FIFO given
as a config, a smoke baseline, a fault plan, a run's metrics, an eval task, a corpus file, a
tokenizer or a held-out task, or lying in a folder goodput lists, is refused (or skipped with a
note) at once, never waited on; a metrics line of a gigabyte is refused by ``FILE:LINE`` in
bounded memory. Each case runs in a child process with a timeout: the old readers blocked in
``open`` until a writer came, forever."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from goodput.testing.jobs import REPO, run_goodput

FIFO_SAYS = "is a FIFO (named pipe), not a regular file"
TIMEOUT_S = 120  # a child that blocks fails the test here; each takes a few seconds at most


def goodput(*argv: str | Path, env: dict[str, str] | None = None, limit_bytes: int = 0):
    """``python -m goodput ARGV`` in a child, under an address-space limit when given."""

    def limit() -> None:
        if limit_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return run_goodput(*argv, cwd=REPO, timeout=TIMEOUT_S, env=env, preexec_fn=limit)


def python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a child Python (for readers no CLI reaches without a trained run)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=REPO,
    )


def fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def refused(result: subprocess.CompletedProcess[str], path: Path, code: int) -> None:
    assert result.returncode == code, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"goodput: error: {path}: {FIFO_SAYS}")


def test_a_fifo_config_is_refused(tmp_path):
    config = fifo(tmp_path / "config.toml")
    refused(goodput("train", config), config, 2)


def test_a_fifo_smoke_baseline_is_refused(tmp_path):
    baseline = fifo(tmp_path / "smoke.json")
    refused(
        goodput("diagnose", "smoke", "configs/tiny-cpu.toml", "--baseline", baseline), baseline, 2
    )


def test_a_fifo_fault_plan_is_refused(tmp_path):
    plan = fifo(tmp_path / "plan.json")
    result = python(f"""
        from goodput.faults import load_plan
        from goodput.errors import GoodputError
        try:
            load_plan({{"GOODPUT_FAULTS": {str(plan)!r}}})
        except GoodputError as error:
            print(error.render())
    """)
    assert result.returncode == 0 and FIFO_SAYS in result.stdout and str(plan) in result.stdout


def _run_dir(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.toml").write_text("[train]\ntokens_per_step = 4096\n")
    return folder


def test_a_fifo_metrics_file_is_refused_by_the_report_and_batch_size(tmp_path):
    run = _run_dir(tmp_path / "run")
    metrics = fifo(run / "metrics.jsonl")
    refused(goodput("report", run), metrics, 1)
    refused(goodput("report", run, "--json"), metrics, 1)
    refused(goodput("diagnose", "batch-size", run), metrics, 2)


def test_a_fifo_attempts_log_is_refused_by_the_report(tmp_path):
    run = _run_dir(tmp_path / "run")
    attempts = fifo(run / "attempts.jsonl")
    refused(goodput("report", run), attempts, 1)


def test_a_metrics_line_of_a_gigabyte_is_named_in_bounded_memory(tmp_path):
    """A sparse gigabyte without a newline after one good line: the reader reads 1 MiB of it,
    under an address space (512 MiB) that the whole line would not fit in."""
    run = _run_dir(tmp_path / "run")
    metrics = run / "metrics.jsonl"
    with open(metrics, "wb") as f:
        f.write(json.dumps({"step": 1, "time": 10.0, "step_time_s": 1.0}).encode() + b"\n")
        f.truncate(f.tell() + (1 << 30))
    for argv in (["report", run], ["diagnose", "batch-size", run]):
        result = goodput(*argv, limit_bytes=512 << 20)
        assert result.returncode in (1, 2), result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"goodput: error: {metrics}:2: is a line longer than 1,048,576")


def test_a_fifo_eval_task_file_is_refused(tmp_path):
    pytest.importorskip("lm_eval")
    task = fifo(tmp_path / "task.yaml")
    refused(goodput("eval", tmp_path / "no-checkpoint", "--tasks", task), task, 2)


def test_a_fifo_beside_a_task_or_in_an_include_path_is_skipped_with_a_note(tmp_path):
    pytest.importorskip("lm_eval")
    from goodput.testing.eval_tasks import write_choice_task

    task = write_choice_task(tmp_path / "tasks")
    beside = fifo(tmp_path / "tasks" / "stale.yaml")
    included = fifo(tmp_path / "more" / "deep" / "other.yaml")
    result = python(f"""
        import os
        for variable in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            os.environ[variable] = "1"
        from pathlib import Path
        from goodput.eval.lm_eval_tasks import load_tasks, resolve_tasks
        tasks = resolve_tasks([{str(task)!r}], [Path({str(tmp_path / "more")!r})])
        print(sorted(load_tasks(tasks)["tasks"]))
    """)
    assert result.returncode == 0, result.stderr
    assert "tiny_arc" in result.stdout
    for path in (beside, included):
        assert f"goodput: note: skipping {path}: not a regular file" in result.stderr


def test_fifo_corpus_files_tokenizers_and_task_files_are_refused_or_skipped(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text('{"text": "hello"}\n')
    pipe = fifo(corpus / "b.jsonl")
    tokenizer = fifo(tmp_path / "tok.model")
    task = fifo(tmp_path / "arc.jsonl")
    result = python(f"""
        from pathlib import Path
        from goodput.data.readers import iter_texts, list_inputs
        from goodput.data.tokenizer import load_tokenizer
        from goodput.errors import GoodputError
        from goodput.eval.choice_tasks import read_choice_task

        print("listed", [path.name for path in list_inputs([Path({str(corpus)!r})])])
        for read in (
            lambda: list_inputs([Path({str(pipe)!r})]),
            lambda: list(iter_texts(Path({str(pipe)!r}))),
            lambda: load_tokenizer({str(tokenizer)!r}, "sentencepiece"),
            lambda: read_choice_task({str(task)!r}, "arc"),
        ):
            try:
                read()
            except GoodputError as error:
                print(error.render())
    """)
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert out[0] == "listed ['a.jsonl']"
    assert f"goodput: note: skipping {pipe}: not a regular file" in result.stderr
    assert [line.split(": ")[0] for line in out[1:]] == [str(pipe)] * 2 + [
        str(tokenizer),
        str(task),
    ]
    assert all(FIFO_SAYS in line for line in out[1:])


@pytest.mark.timeout(20)  # opening a FIFO to write blocked until a reader came
def test_run_files_are_appended_to_only_as_regular_files(tmp_path):
    from goodput.errors import GoodputError
    from goodput.io import open_append

    pipe = fifo(tmp_path / "metrics.jsonl")
    with pytest.raises(GoodputError, match=r"is a FIFO \(named pipe\), not a regular file"):
        open_append(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # with a reader, a writer's open succeeds
    try:
        with pytest.raises(GoodputError, match=r"is a FIFO \(named pipe\), not a regular file"):
            open_append(pipe)
    finally:
        os.close(reader)
    for line in ("x\n", "y\n"):
        with open_append(tmp_path / "evals.jsonl") as out:
            out.write(line)
    assert (tmp_path / "evals.jsonl").read_text() == "x\ny\n"


def test_a_fifo_among_fired_records_is_skipped_with_a_note(tmp_path, capsys):
    from goodput.chaos.records import FiredRecord, read_fired

    record = {"id": 0, "kind": "kill", "step": 3, "rank": 1, "time": 1.7e9}
    (tmp_path / "0.json").write_text(json.dumps(record))
    pipe = fifo(tmp_path / "1.json")
    assert read_fired(tmp_path) == [FiredRecord(**record)]
    assert f"goodput: note: skipping {pipe}: not a regular file" in capsys.readouterr().err


def test_a_broadcast_folder_holding_a_fifo_is_copied_without_it(tmp_path):
    source = tmp_path / "env"
    (source / "lib").mkdir(parents=True)
    (source / "lib" / "a.py").write_text("a = 1\n")
    pipe = fifo(source / "lib" / "control.fifo")
    dest = tmp_path / "nodes" / "{host}" / "env"
    result = goodput(
        "broadcast", source, "--hosts", "x1,x2", "--dest", dest, "--transport", "local"
    )
    assert result.returncode == 0, result.stderr
    assert f"goodput: note: skipping {pipe}: not a regular file" in result.stderr
    for host in ("x1", "x2"):
        copy = tmp_path / "nodes" / host / "env" / "lib"
        assert sorted(path.name for path in copy.iterdir()) == ["a.py"]
