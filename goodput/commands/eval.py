"""``goodput eval``: EleutherAI lm-eval's own evaluator on a checkpoint, offline; one call of
``goodput.eval.lm_eval_tasks.evaluate_checkpoint``, on the device goodput detects
(``GOODPUT_DEVICE`` overrides it), once per rank when launched on several
(``goodput launch --nproc N -- goodput eval ...``: the model sharded over them, rank 0
reporting)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from goodput import argtypes
from goodput.commands import Subparsers
from goodput.errors import ExitCode


def register(groups: Subparsers) -> None:
    command = groups.add_parser(
        "eval",
        help="run lm-eval tasks (names or local .yaml files) on a checkpoint, offline",
        description="Load a checkpoint (or a run directory's newest complete one) and run "
        "EleutherAI lm-eval's evaluator on it with goodput's model, scored as goodput's own "
        "harness scores. Nothing is downloaded: a task's data must be local. Metrics are "
        "printed, and appended to RUN/evals.jsonl (and TensorBoard) when the checkpoint lies "
        "in a run directory. Task files are code: lm-eval's YAML may name Python functions "
        "(!function), which lm-eval imports from the task's folder, and --include-path loads "
        "every task file under a folder; run only task files you would run as scripts. "
        "Needs lm-eval: pip install 'goodput[eval]'.",
    )
    command.set_defaults(handler=_eval)
    command.add_argument(
        "checkpoint",
        type=Path,
        metavar="CHECKPOINT",
        help="a checkpoint directory (RUN/checkpoints/step-N) or a run directory (its newest "
        "complete checkpoint)",
    )
    command.add_argument(
        "--tasks",
        nargs="+",
        required=True,
        metavar="NAME_OR_YAML",
        help="lm-eval task, group or tag names (comma-separated too), or paths of task .yaml "
        "files (their folder is searched for the tasks they name)",
    )
    command.add_argument(
        "--include-path",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="also find task names in the .yaml files under DIR (repeatable)",
    )
    command.add_argument(
        "--limit",
        type=argtypes.positive_int,
        metavar="N",
        help="evaluate only the first N documents of each task",
    )
    command.add_argument(
        "--batch-size",
        type=argtypes.positive_int,
        default=16,
        metavar="N",
        help="requests per forward call (default 16)",
    )
    command.add_argument(
        "--num-fewshot",
        type=argtypes.non_negative_int,
        metavar="N",
        help="few-shot examples per prompt (default: the task's, else 0; a task pinning 0 keeps 0)",
    )
    command.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="the tokenizer file (default: the one the run's blend pins, checked by its sha256)",
    )
    command.add_argument(
        "--json",
        action="store_true",
        help='print one object {"results": {TASK: {METRIC: value}}, "step", "checkpoint"}',
    )
    command.add_argument(
        "--output", type=Path, metavar="FILE", help="also write that JSON object to FILE"
    )
    command.add_argument(
        "--samples",
        type=Path,
        metavar="FILE",
        help="write lm-eval's per-document records (arguments, responses, metrics) to FILE, "
        "one JSON line each",
    )


def _eval(args: argparse.Namespace) -> ExitCode:
    from goodput.eval.lm_eval_tasks import evaluate_checkpoint, require_lm_eval, resolve_tasks
    from goodput.io import print_json, write_json, write_text

    _check_outputs(args)
    require_lm_eval()  # before anything imports it, with the Hugging Face libraries offline
    tasks = resolve_tasks(args.tasks, args.include_path)
    outcome = evaluate_checkpoint(
        args.checkpoint,
        tasks,
        limit=args.limit,
        batch_size=args.batch_size,
        num_fewshot=args.num_fewshot,
        tokenizer_path=args.tokenizer,
        log_samples=args.samples is not None,
    )
    if outcome is None:  # a rank other than 0: rank 0 reports for all
        return ExitCode.OK
    summary = outcome.summary
    if args.output is not None:
        write_json(args.output, summary)
    if args.samples is not None:
        write_text(args.samples, "".join(_sample_lines(outcome.samples or {})))
    if args.json:
        print_json(summary, where="goodput eval --json")
    else:
        print(_table(summary), flush=True)
    return ExitCode.OK


def _check_outputs(args: argparse.Namespace) -> None:
    """--output and --samples: neither in a run or checkpoint (the metrics go to the run's
    evals.jsonl), onto an input or each other, or onto a file that is not their kind."""
    from goodput.outputs import EVAL_SAMPLES, EVAL_SUMMARY, check_output_file

    inputs = [args.checkpoint, *args.include_path]
    inputs += [Path(task) for task in args.tasks if task.endswith((".yaml", ".yml"))]
    inputs += [] if args.tokenizer is None else [args.tokenizer]
    if args.output is not None:
        check_output_file(args.output, EVAL_SUMMARY, "--output", inputs)
    if args.samples is not None:
        others = [*inputs, *([] if args.output is None else [args.output])]
        check_output_file(args.samples, EVAL_SAMPLES, "--samples", others)


def _sample_lines(samples: dict[str, list[dict[str, Any]]]) -> list[str]:
    from goodput.io import json_text

    keys = ("doc_id", "target", "arguments", "filtered_resps", "filter")
    lines = []
    for task, records in samples.items():
        for record in records:
            line = {"task": task, **{key: record.get(key) for key in keys}}
            line["metrics"] = {name: record.get(name) for name in record.get("metrics", [])}
            lines.append(json_text(_plain(line), where="goodput eval --samples") + "\n")
    return lines


def _plain(value: Any) -> Any:
    """lm-eval's ``value`` as JSON holds it: a non-finite number as null (the log-likelihood of
    a continuation the model rules out is -inf), a value JSON has no type for as its text."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, str | int):  # a bool is an int
        return value
    return str(value)


def _table(summary: dict[str, Any]) -> str:
    rows = [("task", "metric", "value", "stderr")]
    for task, metrics in summary["results"].items():
        for name, value in metrics.items():
            metric, comma, filter_name = name.partition(",")
            if metric.endswith("_stderr"):
                continue
            stderr = metrics.get(f"{metric}_stderr{comma}{filter_name}")
            rows.append((task, name, _number(value), _number(stderr)))
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    lines = [f"step {summary['step']} of {summary['checkpoint']}"]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, row[3]]).rstrip())
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"
