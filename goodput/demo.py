"""``make demo``: the whole pipeline on the embedded corpus, on CPU, through the real CLI.

Data (corpus, tokenizer, shards, blend, verify), then training the tiny model of
``configs/tiny-cpu.toml`` on 2 CPU ranks under ``goodput launch``, with its in-loop evals (the
held-out samples of each corpus and ``DEMO_TASK``, a multiple-choice task shipped with the
embedded corpus), ending with the loss curve, the last eval in a few numbers and the run's
report (``goodput report``: the terminal summary, and ``report.html`` with its plots). Each step is
the command a user would type (printed before it runs), so the demo doubles as a walkthrough.
Steps whose output is already complete are cheap to rerun: tokenize resumes and blend hits its
cache. ``--output`` must be new, empty, or a folder the demo made (it holds ``DEMO_MARKER``,
written first): the demo replaces its ``run`` folder.
"""

from __future__ import annotations

import argparse
import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from goodput import cli, rundir, runfiles
from goodput.config import load_config
from goodput.data.blend import BlendSpec, BlendStage, build_blend, format_report
from goodput.data.loader import DataLoader
from goodput.errors import GoodputError
from goodput.io import write_text
from goodput.outputs import check_output_dir, folder_holding
from goodput.train.config.run import RunConfig

DEMO_MARKER = ".goodput-demo"
DEMO_WEIGHTS = {"code": 0.5, "docstrings": 0.3, "docs": 0.2}
VOCAB_SIZE = 4096
TRAIN_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"
NUM_RANKS = 2
SEED = 1234
# 46 lines of standard-library idioms, each continuation against three one-character misspellings
# of it (hellaswag layout): a model that learned the corpus's code spells it.
DEMO_TASK = Path(__file__).resolve().parent / "data" / "demo_tasks" / "python_spelling.jsonl"


def run(argv: list[str]) -> None:
    print(f"\n$ goodput {shlex.join(argv)}", flush=True)
    code = cli.main(argv)
    if code:
        sys.exit(code)


def build_shards(out: Path) -> Path:
    """The demo's data up to the shards: the embedded corpus, its tokenizer and one shard set
    per domain, under ``out``; returns the file list naming them. The same bytes every time
    (`goodput diagnose smoke`'s committed baseline depends on it)."""
    corpus, shards, tokenizer = out / "corpus", out / "shards", out / "tokenizer.model"
    run(["data", "demo-corpus", "--output", str(corpus)])
    if not tokenizer.exists():
        run(
            [
                "data",
                "train-tokenizer",
                str(corpus),
                "--vocab-size",
                str(VOCAB_SIZE),
                "--output",
                str(tokenizer),
            ]
        )
    for domain in DEMO_WEIGHTS:
        run(
            [
                "data",
                "tokenize",
                str(corpus / domain),
                "--tokenizer",
                str(tokenizer),
                "--output",
                str(shards),
                "--name",
                domain,
                "--workers",
                "2",
            ]
        )
    run(["data", "inspect", str(shards / "docs.manifest.json")])
    file_list = out / "file_list.txt"
    write_text(
        file_list,
        "# weight path-prefix corpus\n"
        + "".join(
            f"{weight} shards/{domain}_00000 {domain}\n" for domain, weight in DEMO_WEIGHTS.items()
        ),
    )
    return file_list


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=Path("demo"))
    parser.add_argument("--train-steps", type=int, help="default: the config's train.steps")
    args = parser.parse_args()
    out = args.output
    try:
        check_output_dir(out, folder_holding(DEMO_MARKER), "--output")
    except GoodputError as error:
        print(f"goodput: error: {error.render()}", file=sys.stderr)
        sys.exit(int(error.code))
    write_text(out / DEMO_MARKER, "")
    cfg = load_config(RunConfig, TRAIN_CONFIG)
    steps = args.train_steps or cfg.train.steps
    # The same blend the training run asks for (its length is steps x global batch), so that the
    # trainer's own build below is a cache hit.
    seq_len = cfg.train.seq_len
    num_samples = steps * cfg.train.tokens_per_step // seq_len
    file_list = build_shards(out)
    spec = BlendSpec(
        stages=(BlendStage(file_list, 0),),
        seq_len=seq_len,
        num_samples=num_samples,
        seed=SEED,
        cache=out / "cache",
        holdout_samples=cfg.eval.holdout_samples,
    )
    print(
        f"\n$ goodput data blend {file_list} --seq-len {seq_len} --num-samples {num_samples} "
        f"--seed {SEED} --holdout-samples {spec.holdout_samples} --cache {spec.cache}",
        flush=True,
    )
    blend_dir, manifest = build_blend(spec)  # what the command runs; we need its directory
    print(format_report(blend_dir, manifest))
    run(["data", "verify", str(blend_dir)])
    loader = DataLoader(blend_dir, global_batch_size=8, dp_rank=0, dp_size=1)
    input_ids, labels = next(iter(loader))
    print(
        f"\nfirst global batch: input_ids {tuple(input_ids.shape)}, labels "
        f"{tuple(labels.shape)}; loader state {loader.state_dict()['consumed_samples']} "
        "samples consumed"
    )
    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends; the demo starts afresh
    train_args = [
        "train",
        str(TRAIN_CONFIG),
        f"train.steps={steps}",
        f"train.run_dir={run_dir}",
        f"data.file_list={file_list}",
        f"data.cache={spec.cache}",
        f'eval.tasks=["hellaswag:{DEMO_TASK}"]',
    ]
    launch_args = ["launch", "--nproc", str(NUM_RANKS), "--run-dir", str(run_dir), "--"]
    print(f"\n$ goodput {shlex.join(launch_args)} goodput {shlex.join(train_args)}", flush=True)
    goodput = [sys.executable, "-m", "goodput"]  # this interpreter's goodput, PATH or not
    code = subprocess.call([*goodput, *launch_args, *goodput, *train_args])
    if code:
        sys.exit(code)
    print_loss_curve(run_dir / rundir.METRICS)
    print_last_eval(run_dir / rundir.EVALS)
    # Where the demo's time went, and its plots, in one page that opens offline.
    run(["report", str(run_dir), "--html", str(out / "report.html")])


def print_loss_curve(metrics_file: Path, num_points: int = 7) -> None:
    steps = list(runfiles.read_steps(metrics_file, require=("loss",)))
    losses = [line.number("loss", math.nan) for line in steps]  # null: not finite
    picks = sorted({round(i * (len(steps) - 1) / (num_points - 1)) for i in range(num_points)})
    print(f"\nloss curve ({metrics_file}):")
    for i in picks:
        print(f"  step {steps[i].step:>5}  loss {losses[i]:.3f}")
    first, last = losses[0], losses[-1]
    print(f"loss fell from {first:.3f} to {last:.3f}" if last < first else "loss did not fall")


def print_last_eval(evals_file: Path) -> None:
    records = list(runfiles.read_evals(evals_file))
    step = records[-1].step
    last = {(r.task, r.metric): r for r in records if r.step == step}
    print(f"\neval at step {step} ({evals_file}):")
    for (task, metric), record in last.items():
        if metric in ("loss", "acc"):
            stderr = f" ± {record.stderr:.3f}" if record.stderr is not None else ""
            chance = last.get((task, "chance"))
            against = f" (chance {_shown(chance.value)})" if chance else ""
            print(f"  {task:<22} {metric:<5} {_shown(record.value)}{stderr}{against}")


def _shown(value: float | None) -> str:
    return "null" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
