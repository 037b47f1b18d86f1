"""`goodput eval`: lm-eval's evaluator on a really trained tiny checkpoint with a real SentencePiece
tokenizer, offline, on local task files: the --json schema, RUN/evals.jsonl and TensorBoard; the
LM class pinned by hand on a bigram table; rolling log-likelihoods against the model's own token
loss; generation against goodput's generate; and the one-line refusals."""

import functools
import json
import math
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from goodput import cli
from goodput.data.tokenizer import load_tokenizer
from goodput.eval.generate import generate
from goodput.eval.lm_eval_tasks import OFFLINE_VARIABLES, load_tasks, resolve_tasks, run_tasks
from goodput.testing.bigram import BigramModel, CharTokenizer
from goodput.testing.eval_tasks import (
    write_choice_task,
    write_generation_task,
    write_rolling_task,
)
from goodput.testing.tiny import TINY_MODEL, tokenized_run_config
from goodput.train.convert.checkpoints import (
    load_model_state,
    read_model_config,
    write_model_only_checkpoint,
)
from goodput.train.loop import train
from goodput.train.loss import token_loss_sum
from goodput.train.model import Transformer

for _variable in OFFLINE_VARIABLES:  # before lm-eval (and datasets) are first imported
    os.environ.setdefault(_variable, "1")
pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from goodput.eval import lm_eval_model  # noqa: E402
from goodput.eval.lm_eval_model import GoodputLM, cut_at_first  # noqa: E402
from goodput.progress import Progress  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run trained 8 steps on shards tokenized with a real SentencePiece model (its
    blend pins it); the model's vocabulary (320) is padded past the tokenizer's (300)."""
    root = tmp_path_factory.mktemp("eval")
    cfg, tokenizer = tokenized_run_config(root)
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, interval_steps=8, async_save=False))
    train(cfg)
    return root / "tiny" / "run", tokenizer


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    return SimpleNamespace(
        choice=write_choice_task(folder),
        rolling=write_rolling_task(folder),
        generation=write_generation_task(folder),
    )


@pytest.fixture
def offline(monkeypatch):
    """Any connection attempt fails the test: goodput eval must never reach the network."""

    def refuse(self, address):
        raise AssertionError(f"goodput eval tried to connect to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def eval_cli(capsys, *argv):
    try:
        code = cli.main(["eval", *map(str, argv)])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def read_samples(path: Path) -> dict[str, list[dict]]:
    samples: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        samples.setdefault(record["task"], []).append(record)
    return {task: sorted(records, key=lambda r: r["doc_id"]) for task, records in samples.items()}


def load_run_model(run_dir: Path) -> Transformer:
    step = run_dir / "checkpoints" / "step-00000008"
    cfg = read_model_config(step)
    model = Transformer(cfg).eval()
    model.load_state_dict(load_model_state(step, cfg))
    return model


# --- goodput eval on the trained run ---------------------------------------------------------


def test_json_results_evals_jsonl_and_tensorboard(run, tasks, capsys, tmp_path, offline):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = run
    evals = run_dir / "evals.jsonl"
    before = evals.read_text().splitlines() if evals.exists() else []
    output = tmp_path / "out" / "eval.json"
    argv = [run_dir, "--tasks", tasks.choice, tasks.rolling, "--json", "--output", output]
    code, out, err = eval_cli(capsys, *argv)
    assert code == 0, err
    (line,) = out.splitlines()
    summary = json.loads(line)
    assert json.loads(output.read_text()) == summary
    assert summary["step"] == 8
    assert summary["checkpoint"] == str(run_dir / "checkpoints" / "step-00000008")
    arc = summary["results"]["tiny_arc"]
    assert set(arc) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert 0 <= arc["acc"] <= 1 and arc["acc_stderr"] == pytest.approx(
        math.sqrt(arc["acc"] * (1 - arc["acc"]) / 39)
    )
    text = summary["results"]["tiny_text"]
    assert set(text) == {
        "word_perplexity",
        "word_perplexity_stderr",
        "byte_perplexity",
        "byte_perplexity_stderr",
        "bits_per_byte",
        "bits_per_byte_stderr",
    }
    assert text["word_perplexity_stderr"] is None  # lm-eval's "N/A"
    assert text["bits_per_byte"] == pytest.approx(math.log2(text["byte_perplexity"]))
    # RUN/evals.jsonl: one line per metric, the standard error beside its metric.
    added = [json.loads(line) for line in evals.read_text().splitlines()[len(before) :]]
    found = {(r["task"], r["metric"]): (r["value"], r["stderr"]) for r in added}
    assert found == {
        ("tiny_arc", "acc"): (arc["acc"], arc["acc_stderr"]),
        ("tiny_arc", "acc_norm"): (arc["acc_norm"], arc["acc_norm_stderr"]),
        ("tiny_text", "word_perplexity"): (text["word_perplexity"], None),
        ("tiny_text", "byte_perplexity"): (text["byte_perplexity"], None),
        ("tiny_text", "bits_per_byte"): (text["bits_per_byte"], None),
    }
    assert {(r["step"], r["source"]) for r in added} == {(8, "goodput eval")}
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("eval/tiny_arc/acc")  # other tests of this run add theirs
    assert any(s.step == 8 and s.value == pytest.approx(arc["acc"]) for s in scalars)
    assert "eval/tiny_text/bits_per_byte" in events.Tags()["scalars"]


def test_a_step_directory_prints_a_table(run, tasks, capsys, offline):
    run_dir, _ = run
    step = run_dir / "checkpoints" / "step-00000008"
    code, out, err = eval_cli(capsys, step, "--tasks", tasks.choice, "--limit", 5)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"step 8 of {step}"
    assert lines[1].split() == ["task", "metric", "value", "stderr"]
    assert [line.split()[:2] for line in lines[2:]] == [
        ["tiny_arc", "acc"],
        ["tiny_arc", "acc_norm"],
    ]
    assert f"goodput eval: {step} on " in err  # which checkpoint, said on stderr


def test_rolling_loglikelihood_is_the_models_own_token_loss_sum(run, tasks, capsys, tmp_path):
    """Each document scored as a held-out corpus is: after the end-of-document token, in
    windows of the model's 64 positions, each token predicted once; the last window reads a
    full 64 positions of context, so it is computed here on its own."""
    run_dir, tokenizer_file = run
    samples_file = tmp_path / "samples.jsonl"
    code, _, err = eval_cli(capsys, run_dir, "--tasks", tasks.rolling, "--samples", samples_file)
    assert code == 0, err
    model, tokenizer = load_run_model(run_dir), load_tokenizer(tokenizer_file)
    length = model.cfg.max_seq_len
    documents = read_samples(samples_file)["tiny_text"]
    assert max(len(tokenizer.encode_batch([d["target"]])[0]) for d in documents) > 2 * length
    for document in documents:
        tokens = tokenizer.encode_batch([document["target"]])[0]
        sequence = [tokenizer.eod_id, *tokens]  # sequence[i + 1] is tokens[i]
        total = 0.0
        for start in range(0, len(tokens), length):
            end = min(start + length, len(tokens))  # predict tokens[start:end]
            first = max(0, end - length)  # the inputs sequence[first:end] predict up to end
            inputs = torch.tensor([sequence[first:end]])
            with torch.no_grad():
                logits = model(inputs)[0, start - first :]
            total -= float(token_loss_sum(logits[None], torch.tensor([tokens[start:end]])))
        (loglikelihood,) = document["filtered_resps"]
        assert loglikelihood == pytest.approx(total, abs=1e-4)


def test_generate_until_is_goodputs_greedy_generation(run, tasks, capsys, tmp_path):
    run_dir, tokenizer_file = run
    samples_file = tmp_path / "samples.jsonl"
    code, _, err = eval_cli(capsys, run_dir, "--tasks", tasks.generation, "--samples", samples_file)
    assert code == 0, err
    model, tokenizer = load_run_model(run_dir), load_tokenizer(tokenizer_file)
    documents = read_samples(samples_file)["tiny_generate"]
    assert len(documents) == 5
    for document in documents:
        ((prompt, gen_kwargs),) = document["arguments"]
        assert gen_kwargs["until"] == [" beta"] and gen_kwargs["max_gen_toks"] == 12
        ids = tokenizer.encode_batch([prompt])[0]
        result = generate(model, ids, max_new_tokens=12, eod_id=tokenizer.eod_id, vocab_size=300)
        expected = cut_at_first(tokenizer.decode(result.tokens), [" beta"])
        assert document["filtered_resps"] == [expected]


def test_batch_size_changes_no_score(run, tasks):
    run_dir, _ = run
    loaded = resolve_tasks([str(tasks.choice)])
    scores = []
    for batch_size in (1, 7):
        lm = GoodputLM.from_checkpoint(run_dir, None, batch_size=batch_size)
        results = run_tasks(lm, load_tasks(loaded), log_samples=True)
        assert results is not None
        scores.append([s["filtered_resps"] for s in results["samples"]["tiny_arc"]])
    for one, seven in zip(*scores, strict=True):
        assert [ll for ll, _ in one] == pytest.approx([ll for ll, _ in seven], abs=1e-5)


# --- the LM class by hand --------------------------------------------------------------------


def instances(request_type, arguments):
    return [
        Instance(request_type, {}, args, idx, metadata=("hand", doc_id, 1))
        for doc_id, (idx, args) in enumerate(enumerate(arguments))
    ]


def test_loglikelihood_and_is_greedy_by_hand():
    lm = GoodputLM(BigramModel(), CharTokenizer(" ab"), batch_size=2)  # type: ignore[arg-type]
    L = math.log
    results = lm.loglikelihood(
        instances(
            "loglikelihood",
            [
                ("a", " b"),  # P(" " | a) P(b | " "): " " is not a's argmax (a is)
                ("b", "b"),  # P(b | b), the argmax after b
                ("", " a"),  # no context: after the end of document; both argmaxes
                ("ab", "bb"),  # P(b | b)^2
            ],
        )
    )
    expected = [(L(0.2 * 0.3), False), (L(0.4), True), (L(0.3 * 0.5), True), (L(0.4 * 0.4), True)]
    for (value, greedy), (want, want_greedy) in zip(results, expected, strict=True):
        assert value == pytest.approx(want, abs=1e-6) and greedy is want_greedy


def test_each_request_type_shows_its_progress_on_stderr(monkeypatch, capsys):
    # A line after every batch (interval 0), then the closing line; stdout stays the result's.
    monkeypatch.setattr(lm_eval_model, "Progress", functools.partial(Progress, interval_s=0))
    lm = GoodputLM(BigramModel(), CharTokenizer(" ab"), batch_size=2)  # type: ignore[arg-type]
    lm.loglikelihood(instances("loglikelihood", [("a", " b"), ("b", "b"), ("", " a")]))
    out, err = capsys.readouterr()
    first, second, closing = err.splitlines()
    assert first.startswith("goodput eval: loglikelihood: 66.7% 2 of 3 requests, ")
    assert second.startswith("goodput eval: loglikelihood: 100.0% 3 of 3 requests, ")
    assert closing.startswith("goodput eval: loglikelihood: 100.0% 3 of 3 requests in ")
    assert out == ""
    lm.loglikelihood_rolling(instances("loglikelihood_rolling", [("ab",), ("b",)]))
    closing = capsys.readouterr().err.splitlines()[-1]
    assert closing.startswith("goodput eval: loglikelihood_rolling: 100.0% 2 of 2 windows in ")


@pytest.mark.parametrize("max_len", [1, 2, 64])
def test_rolling_windows_predict_each_token_once_by_hand(max_len):
    # A bigram reads only the token before: every window length gives the same sum.
    lm = GoodputLM(BigramModel(max_len), CharTokenizer(" ab"))  # type: ignore[arg-type]
    texts = ["ab a", "", "b"]
    L = math.log
    want = [L(0.3 * 0.3 * 0.3 * 0.5), 0.0, L(0.3)]
    got = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(t,) for t in texts]))
    assert got == pytest.approx(want, abs=1e-6)


def test_generate_until_stops_at_the_first_stop_string():
    torch.manual_seed(0)
    model = Transformer(replace(TINY_MODEL, max_seq_len=64, init_std=0.3)).eval()
    tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz .,?!ABCDEFGHIJKLMNOPQRSTUVWXYZ012")
    prompt = "the cat"
    ids = tokenizer.encode_batch([prompt])[0]
    full = generate(model, ids, max_new_tokens=20, eod_id=tokenizer.eod_id).tokens
    text = tokenizer.decode(full)
    assert len(text) == 20 and len(set(text)) > 4  # varied, and no end of document
    stop = text[8:10]
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    lm = GoodputLM(model, tokenizer)
    kwargs = {"until": [stop, "never"], "max_gen_toks": 20, "do_sample": False}
    (result,) = lm.generate_until(instances("generate_until", [(prompt, kwargs)]))
    assert result == text[: text.find(stop)]
    assert len(forwards) <= text.find(stop) + len(stop)  # it stopped there, not after 20
    forwards.clear()
    unlimited = {"until": [], "max_gen_toks": 6}
    (result,) = lm.generate_until(instances("generate_until", [(prompt, unlimited)]))
    assert result == text[:6] and len(forwards) == 6


def test_cut_at_first():
    assert cut_at_first("one two three", [" three", " two"]) == "one"
    assert cut_at_first("one two", ["four"]) == "one two"
    assert cut_at_first("one", []) == "one"


# --- refusals ---------------------------------------------------------------------------------


def test_without_lm_eval_it_says_how_to_install_it(run, tasks, capsys, monkeypatch):
    run_dir, _ = run
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now fails
    code, out, err = eval_cli(capsys, run_dir, "--tasks", tasks.choice)
    assert code == 1 and out == ""
    assert err == (
        "goodput: error: goodput eval: lm-eval is not installed; pip install 'goodput[eval]'\n"
    )


def model_only_copy(run_dir: Path, out: Path) -> Path:
    step = run_dir / "checkpoints" / "step-00000008"
    cfg = read_model_config(step)
    return write_model_only_checkpoint(out, load_model_state(step, cfg).items(), cfg)


def test_a_model_only_checkpoint_with_tokenizer_is_evaluated_and_not_recorded(
    run, tasks, capsys, tmp_path
):
    run_dir, tokenizer_file = run
    imported = model_only_copy(run_dir, tmp_path / "imported")
    capsys.readouterr()
    argv = [imported, "--tasks", tasks.choice, "--tokenizer", tokenizer_file, "--json"]
    code, out, err = eval_cli(capsys, *argv)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["step"] == 0 and set(summary["results"]) == {"tiny_arc"}
    # The same weights as the run's step 8: the same numbers.
    code, again, err = eval_cli(capsys, run_dir, "--tasks", tasks.choice, "--json")
    assert json.loads(again)["results"] == summary["results"]
    assert not (tmp_path / "imported" / "evals.jsonl").exists()  # no run.json: not a run


def bad_task_files(folder: Path) -> dict[str, Path]:
    folder.mkdir(exist_ok=True)
    files = {
        "broken": "task: [unclosed\n",
        "nameless": "dataset_path: json\n",
        "no-data": (
            "task: no_data\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {folder / 'nothing.jsonl'}\ntest_split: test\n"
            'output_type: multiple_choice\ndoc_to_text: "x"\ndoc_to_target: 0\n'
            'doc_to_choice: ["a", "b"]\n'
        ),
    }
    for name, text in files.items():
        (folder / f"{name}.yaml").write_text(text)
    return {name: folder / f"{name}.yaml" for name in files}


@pytest.mark.parametrize(
    ("case", "code", "says"),
    [
        ("missing-yaml", 2, "no such task file"),
        ("broken-yaml", 2, "not an lm-eval task file: ParserError"),
        ("nameless-yaml", 2, "not an lm-eval task file"),
        ("missing-data", 1, "nothing.jsonl: No such file or directory (data of lm-eval task"),
        ("limit-0", 2, "argument --limit: 0 is not in"),
        ("limit-negative", 2, "argument --limit: -3 is not in"),
        ("batch-size-0", 2, "argument --batch-size"),
        ("no-tasks", 2, "--tasks"),
        ("missing-include-path", 2, "no such folder"),
        ("unknown-name", 2, "'tiny_arcc' is no lm-eval task, group or tag (close: tiny_arc"),
        ("not-a-checkpoint", 2, "neither a checkpoint directory"),
        ("missing-checkpoint", 2, "no such checkpoint or run directory"),
        ("incomplete-checkpoint", 1, "incomplete checkpoint"),
        ("model-only-checkpoint", 2, "a model-only checkpoint names no data"),
    ],
)
def test_bad_input_is_one_line(run, tasks, capsys, tmp_path, case, code, says):
    run_dir, _ = run
    bad = bad_task_files(tmp_path / "bad")
    target, task = run_dir, str(tasks.choice)
    extra: list[object] = []
    if case == "missing-yaml":
        task = str(tmp_path / "nowhere" / "task.yaml")
    elif case == "broken-yaml":
        task = str(bad["broken"])
    elif case == "nameless-yaml":
        task = str(bad["nameless"])
    elif case == "missing-data":
        task = str(bad["no-data"])
    elif case == "limit-0":
        extra = ["--limit", 0]
    elif case == "limit-negative":
        extra = ["--limit", -3]
    elif case == "batch-size-0":
        extra = ["--batch-size", 0]
    elif case == "missing-include-path":
        extra = ["--include-path", tmp_path / "no-folder"]
    elif case == "unknown-name":
        task, extra = "tiny_arcc", ["--include-path", tasks.choice.parent]
    elif case == "not-a-checkpoint":
        target = tmp_path
    elif case == "missing-checkpoint":
        target = tmp_path / "nothing"
    elif case == "incomplete-checkpoint":
        target = tmp_path / "step-00000008"
        target.mkdir()
    elif case == "model-only-checkpoint":
        target = model_only_copy(run_dir, tmp_path / "imported")
        capsys.readouterr()
    argv = [target, *([] if case == "no-tasks" else ["--tasks", task]), *extra, "--json"]
    found, out, err = eval_cli(capsys, *argv)
    assert found == code and out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("goodput: error: ") and says in err and "Traceback" not in err


# --- hostile task data: named by file and line, not as lm-eval's or datasets' own error -------

GOOD_LINE = (
    b'{"id": "Q1", "question": "alpha beta", "choices": {"text": ["gamma", "delta"], '
    b'"label": ["A", "B"]}, "answerKey": "B"}\n'
)
HOSTILE_DATA = {
    "malformed-line": (GOOD_LINE + b'{"id": bad\n', ":2: is not JSON"),
    "not-utf8": (GOOD_LINE + b'{"question": "\xff"}\n', ":2: is not UTF-8: byte 0xff"),
    "utf-16": (GOOD_LINE.decode().encode("utf-16"), ":1: is not UTF-8"),
    "not-an-object": (GOOD_LINE + b"[1, 2]\n", ":2: is a JSON list, not an object"),
    "broken-array": (b"[" + GOOD_LINE + b',{"id": }]\n', ":2: is not JSON"),
    "wrong-fields": (
        GOOD_LINE + b'{"id": 5, "question": 3, "choices": 7, "answerKey": "B"}\n',
        "could not build its prompts from its data: UndefinedError",
    ),
}


def hostile_task(folder: Path, case: str) -> tuple[Path, Path]:
    """A choice task whose data file holds ``HOSTILE_DATA[case]`` (or is a FIFO)."""
    task = write_choice_task(folder, name=f"hostile_{case.replace('-', '_')}", num_items=2)
    data = task.with_suffix(".jsonl")
    data.unlink()
    if case == "fifo":
        os.mkfifo(data)
    else:
        data.write_bytes(HOSTILE_DATA[case][0])
    return task, data


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [*HOSTILE_DATA, "fifo"])
def test_hostile_task_data_is_one_line_naming_the_file(run, capsys, tmp_path, case):
    run_dir, _ = run
    task, data = hostile_task(tmp_path, case)
    found, out, err = eval_cli(capsys, run_dir, "--tasks", task, "--json")
    # lm-eval's and datasets' own progress and log lines come first on stderr (and, in one
    # process, datasets' handler may still hold an earlier test's closed stream): ours is last.
    errors = [line for line in err.splitlines() if line.startswith("goodput: error: ")]
    assert found == 1 and out == ""
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
    says = "is a FIFO (named pipe), not a regular file" if case == "fifo" else HOSTILE_DATA[case][1]
    assert says in errors[0]
    if case == "wrong-fields":  # the templates fail, not the file: the task file is named
        assert str(task) in errors[0]
    else:
        assert str(data) in errors[0] and "DatasetGenerationError" not in errors[0]


def test_a_malformed_data_line_is_named_by_the_command(run, tmp_path):
    """The same, from the command a user runs: one line on stderr, exit 1, nothing on stdout."""
    run_dir, _ = run
    task, data = hostile_task(tmp_path, "malformed-line")
    child = subprocess.run(
        [sys.executable, "-m", "goodput", "eval", str(run_dir), "--tasks", str(task)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf")},
    )
    assert child.returncode == 1 and child.stdout == ""
    last = child.stderr.splitlines()[-1]
    assert last.startswith(f"goodput: error: {data}:2: is not JSON"), child.stderr
    assert "Traceback" not in child.stderr


def test_bad_generation_kwargs_name_the_task_not_an_option():
    from goodput.errors import GoodputError

    where = "lm-eval task t, document 0, request 0"
    for kwargs, says in [
        ({"do_sample": True, "temperature": -1.0, "until": ["x"]}, "temperature -1.0 is not"),
        ({"do_sample": True, "temperature": "hot", "until": ["x"]}, "ValueError"),
        ({"do_sample": True, "temperature": 1.0, "top_p": 2.0, "until": ["x"]}, "top_p 2.0"),
        ({"max_gen_toks": "many", "until": ["x"]}, "ValueError"),
    ]:
        with pytest.raises(GoodputError) as caught:
            lm_eval_model.generation_settings(kwargs, where)
        assert caught.value.where == f"{where}: generation_kwargs" and caught.value.code == 2
        assert says in caught.value.what
    until, max_new, sampling = lm_eval_model.generation_settings(
        {"do_sample": True, "temperature": 1e-300, "until": ["x"], "max_gen_toks": 3}, where
    )
    assert (until, max_new, sampling.temperature) == (["x"], 3, 1e-300)
