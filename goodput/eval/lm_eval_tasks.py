"""lm-eval tasks on a goodput checkpoint: what ``goodput eval`` calls.

Owns ``require_lm_eval`` (the import, offline, or the one-line fix), ``resolve_tasks`` (``--tasks``
names and task ``.yaml`` paths -> ``Tasks``), ``load_tasks`` (lm-eval's ``TaskManager`` builds
them, reading their data), ``run_tasks`` (an lm-eval ``LM`` and loaded tasks -> lm-eval's own
results, through ``lm_eval.evaluator.evaluate``), ``metrics_of`` (those results -> ``{task:
{metric: value}}``) and ``evaluate_checkpoint`` (all of it on a checkpoint, recorded in its run
directory). Every refusal comes before anything is printed, so it is the one line printed.

Offline. ``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1`` are set (unless already set) before
lm-eval is imported, so a task's data must be local: a ``data_files`` path, or a data set
already in the Hugging Face cache. Nothing is downloaded.

Tasks. A ``--tasks`` entry naming a ``.yaml``/``.yml`` file (or holding a ``/``) is a task file:
it is loaded from that path, its folder is added to the include paths (so a group there finds
its sibling tasks) and its ``task:`` (or ``group:``) name keys the results. Any other entry is a
name lm-eval knows (comma-separated names are split, as lm-eval's ``--tasks`` splits them);
lm-eval's ~15,000 bundled task files are indexed (~6 s) only for a name that the include paths
do not define. A named task file must be a regular file, and a ``*.yaml`` in the folders that is
not one (a FIFO, on which lm-eval's ``open`` would wait forever) is skipped with a note
(``regular_task_files``).

Running. ``run_tasks`` does what ``lm_eval.simple_evaluate`` does around ``evaluate`` and no
more: lm-eval's default seeds (Python 0, NumPy, torch and few-shot 1234), ``num_fewshot`` set on
each task unless its config pins 0 (default 0), lm-eval's default bootstrap iterations
(standard errors of means are closed-form, sqrt(p(1 - p) / (n - 1)) as goodput's harness). It
skips what ``simple_evaluate`` adds after: environment and git probes (subprocesses) and model
construction from a name. Distributed (``goodput launch``): the model is sharded over the ranks,
every rank runs every request (lm-eval sees one process on each) and only rank 0 reports.

Recording. ``evaluate_checkpoint`` appends every metric to ``RUN/evals.jsonl``
(``records.append_evals``, source ``"goodput eval"``) and, when tensorboard is installed, writes
``eval/<task>/<metric>`` scalars at the checkpoint's step to ``RUN/tensorboard``, when the
checkpoint lies in a run directory (``RUN/checkpoints/step-N`` with ``RUN/run.json``). Metric
names are lm-eval's without the ``,none`` filter suffix (another filter keeps its suffix).

It does not download data, apply chat templates, or score anything itself (``lm_eval_model``).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import math
import os
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from goodput import rundir
from goodput.errors import GoodputError
from goodput.eval.records import EvalRecord, append_evals
from goodput.eval.task_data import naming_task_data
from goodput.io import is_folder, read_json, regular_files, require_regular

OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
TASK_FILE_SUFFIXES = (".yaml", ".yml")
NO_FILTER = "none"  # lm-eval's name for "no filter": its metric keys end in ",none"
MAX_SUGGESTIONS = 3
TASK_FILE_FIX = (
    "an lm-eval task file is a YAML mapping with `task:`, `dataset_path:`, `output_type:` ... "
    "(see docs/evals.md)"
)


def require_lm_eval() -> None:
    """Import lm-eval with the Hugging Face libraries offline, or say how to install it."""
    for variable in OFFLINE_VARIABLES:
        os.environ.setdefault(variable, "1")
    try:
        importlib.import_module("lm_eval")
        importlib.import_module("lm_eval.evaluator")
    except ImportError:
        raise GoodputError(
            "goodput eval", "lm-eval is not installed", "pip install 'goodput[eval]'"
        ) from None


@dataclass(frozen=True, slots=True)
class Tasks:
    """What ``TaskManager.load`` gets: ``specs`` (names, and task file paths); ``names`` the
    results' keys in the same order; the folders whose task files to index."""

    specs: list[str]
    names: list[str]
    include_paths: list[Path] = field(default_factory=list)


def resolve_tasks(entries: Sequence[str], include_paths: Sequence[Path] = ()) -> Tasks:
    """The ``--tasks`` entries and ``--include-path`` folders as lm-eval loads them (see the
    module docstring); a missing file or folder, or an unreadable task file, is one line."""
    from lm_eval.tasks._index import TaskIndex  # lm-eval's own reader of a task file's name

    folders = []
    for folder in include_paths:
        if not is_folder(folder):  # a loop of links is named as one
            raise GoodputError.usage(
                folder, "no such folder", "pass --include-path a folder of lm-eval task files"
            )
        folders.append(folder.resolve())
    specs, names = [], []
    for entry in entries:
        if entry.endswith(TASK_FILE_SUFFIXES) or "/" in entry:
            path = Path(entry)
            if not os.path.lexists(path):
                raise GoodputError.usage(
                    path,
                    "no such task file",
                    "pass an lm-eval task .yaml file that exists, or a task name",
                )
            try:  # lm-eval opens it itself: a FIFO would block it forever
                require_regular(path)
            except GoodputError as error:
                raise GoodputError.usage(error.where, error.what, error.fix) from None
            try:
                found = TaskIndex.entry_from_path(path)
            except Exception as error:  # YAML syntax, a non-mapping, an !function that fails
                raise GoodputError.usage(
                    path, f"not an lm-eval task file: {_first_line(error)}", TASK_FILE_FIX
                ) from None
            if found is None or not isinstance(found.name, str):
                raise GoodputError.usage(path, "has no `task:` or `group:` name", TASK_FILE_FIX)
            specs.append(str(path.resolve()))
            names.append(found.name)
            if path.resolve().parent not in folders:
                folders.append(path.resolve().parent)
            continue
        for name in filter(None, (part.strip() for part in entry.split(","))):
            specs.append(name)
            names.append(name)
    if not specs:
        raise GoodputError.usage("--tasks", "names no task", "pass a task name or a .yaml file")
    return Tasks(specs, names, folders)


def run_tasks(
    lm: Any,
    loaded: Any,
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
) -> dict[str, Any] | None:
    """lm-eval's results of ``lm`` (any lm-eval ``LM``) on ``loaded`` (``load_tasks``): its
    ``results`` (and ``samples`` with ``log_samples``) dict on rank 0, None on the others."""
    import numpy as np
    import torch
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.evaluator import evaluate

    if limit is not None and limit < 1:
        raise GoodputError.usage("--limit", f"{limit} is not a positive count", "pass 1 or more")
    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)
    for task in loaded["tasks"].values():
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    with naming_task_data():  # a task whose templates do not fit its data is named
        results = evaluate(lm=lm, task_dict=loaded, limit=limit, log_samples=log_samples)
    return None if results is None else dict(results)


def load_tasks(tasks: Tasks) -> Any:
    """lm-eval's task dict of ``tasks`` (``TaskManager.load``), each task's data read; an
    unknown name or unreadable data is one line."""
    from lm_eval.tasks import TaskManager

    include_path = [str(path) for path in tasks.include_paths] or None
    with regular_task_files():
        manager = TaskManager(include_path=include_path, include_defaults=False)
        named = [name for spec, name in zip(tasks.specs, tasks.names, strict=True) if spec == name]
        if any(name not in manager.all_tasks for name in named):
            # Index lm-eval's bundled tasks (seconds) only for a name the given folders lack.
            manager = TaskManager(include_path=include_path, include_defaults=True)
    for name in named:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=MAX_SUGGESTIONS)
            hint = f" (close: {', '.join(close)})" if close else ""
            raise GoodputError.usage(
                "--tasks",
                f"{name!r} is no lm-eval task, group or tag{hint}",
                "`lm-eval ls tasks` lists them; or pass a task .yaml file",
            )
    try:
        with naming_task_data():  # a bad data file is named by its path and line
            return manager.load(tasks.specs)
    except GoodputError:
        raise
    except Exception as error:  # a task file's values lm-eval refuses, or a data set offline
        files = [spec for spec, name in zip(tasks.specs, tasks.names, strict=True) if spec != name]
        raise GoodputError(
            f"lm-eval task {', '.join(tasks.names)}" + (f" ({', '.join(files)})" if files else ""),
            f"could not be loaded: {_first_line(error)}",
            "check the task file's settings (docs/evals.md) and that its data is local (a "
            "data_files path that exists, or a data set already in the Hugging Face cache: "
            "goodput eval runs offline)",
        ) from None


@contextlib.contextmanager
def regular_task_files() -> Iterator[None]:
    """While lm-eval indexes its task folders: the ``*.yaml`` files it lists, and would open,
    pass through ``io.regular_files``, so one that is no regular file (a FIFO, which would
    block it forever) is skipped with a note, in lm-eval's own order."""
    from lm_eval.tasks._index import TaskIndex

    listing = TaskIndex.__dict__["_iter_yaml_files"]
    original = TaskIndex._iter_yaml_files

    def regular_yaml_files(root: Path) -> Iterator[Path]:
        found = list(original(root))
        kept = set(regular_files(found))
        return (path for path in found if path in kept)

    TaskIndex._iter_yaml_files = staticmethod(regular_yaml_files)  # type: ignore[method-assign]
    try:
        yield
    finally:
        TaskIndex._iter_yaml_files = listing  # type: ignore[method-assign]


def metrics_of(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """``{task: {metric: value}}`` of lm-eval's results: its numeric ``metric,filter`` entries
    with ``,none`` dropped; a missing standard error (lm-eval's ``"N/A"``) or a non-finite
    value is None."""
    metrics: dict[str, dict[str, float | None]] = {}
    for task, entries in results["results"].items():
        values: dict[str, float | None] = {}
        for key, value in entries.items():
            if "," not in key:  # "alias", "name", "sample_len": not metrics
                continue
            metric, _, filter_name = key.partition(",")
            name = metric if filter_name == NO_FILTER else key
            number = (
                value if isinstance(value, int | float) and not isinstance(value, bool) else None
            )
            values[name] = float(number) if number is not None and math.isfinite(number) else None
        metrics[task] = values
    return metrics


def eval_records(metrics: dict[str, dict[str, float | None]]) -> list[EvalRecord]:
    """One record per task and metric with a value, its ``_stderr`` entry as its stderr."""
    records = []
    for task, values in metrics.items():
        for name, value in values.items():
            metric, comma, filter_name = name.partition(",")
            if metric.endswith("_stderr") or value is None:
                continue
            stderr = values.get(f"{metric}_stderr{comma}{filter_name}")
            records.append(EvalRecord(task, name, value, stderr))
    return records


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointEval:
    """What ``goodput eval`` reports: ``summary`` is its ``--json`` object; ``samples``
    lm-eval's per-document records when asked for."""

    summary: dict[str, Any]
    samples: dict[str, list[dict[str, Any]]] | None
    run_dir: Path | None  # where the metrics were recorded, if anywhere


def evaluate_checkpoint(
    path: Path,
    tasks: Tasks,
    *,
    limit: int | None = None,
    batch_size: int = 16,
    num_fewshot: int | None = None,
    tokenizer_path: Path | None = None,
    log_samples: bool = False,
) -> CheckpointEval | None:
    """Run ``tasks`` on the checkpoint (or run directory's newest) at ``path``: in this one
    process, or sharded over the ranks of a launch (``goodput.eval.inference``); record on
    rank 0 (see the module docstring). None on ranks other than 0."""
    from goodput.eval.inference import is_rank_zero, joined_ranks, resolve_checkpoint
    from goodput.eval.lm_eval_model import GoodputLM

    # Progress and warnings (ours and lm-eval's) go to stderr; stdout carries only the result.
    with contextlib.redirect_stdout(sys.stderr), joined_ranks() as runtime:
        directory = resolve_checkpoint(path)
        # The checkpoint's and tokenizer's refusals, then the data's (which may print
        # progress): a refusal is the one line printed.
        lm = GoodputLM.from_checkpoint(
            directory, runtime, tokenizer_path=tokenizer_path, batch_size=batch_size
        )
        loaded = load_tasks(tasks)
        if is_rank_zero():
            ranks = f", sharded over {runtime.world_size} ranks" if runtime else ""
            print(f"goodput eval: {directory} on {lm.device}{ranks}", flush=True)
        results = run_tasks(
            lm, loaded, limit=limit, num_fewshot=num_fewshot, log_samples=log_samples
        )
        if not is_rank_zero():  # every rank computed the same; rank 0 reports
            return None
    assert results is not None, "lm-eval returns results to a single process"
    metrics = metrics_of(results)
    step = checkpoint_step(directory)
    run_dir = run_dir_of(directory)
    if run_dir is not None:
        records = eval_records(metrics)
        append_evals(run_dir, step, records, source="goodput eval")
        write_tensorboard(run_dir, step, records)
    summary = {"results": metrics, "step": step, "checkpoint": str(directory)}
    samples = results.get("samples") if log_samples else None
    return CheckpointEval(summary=summary, samples=samples, run_dir=run_dir)


def checkpoint_step(directory: Path) -> int:
    """The optimizer step of a checkpoint's weights: its ``train_state.json``, else its name."""
    state = read_json(directory / rundir.TRAIN_STATE)
    step = state.get("step") if isinstance(state, dict) else None
    if type(step) is int and step >= 0:
        return step
    match = rundir.STEP_DIR.fullmatch(directory.name)
    assert match is not None, "a resolved checkpoint is a step-N directory"
    return int(match.group(1))


def run_dir_of(directory: Path) -> Path | None:
    """The run directory holding checkpoint ``directory``, if it lies in one."""
    run_dir = directory.parent.parent
    in_run = directory.parent.name == rundir.CHECKPOINTS and (run_dir / rundir.RUN_RECORD).is_file()
    return run_dir if in_run else None


def write_tensorboard(run_dir: Path, step: int, records: Sequence[EvalRecord]) -> None:
    """``eval/<task>/<metric>`` scalars at ``step`` in ``RUN/tensorboard`` when tensorboard is
    installed (evals.jsonl has them all the same)."""
    from goodput.train.metrics import tensorboard_writer

    writer = tensorboard_writer(run_dir, "goodput eval", rundir.EVALS, file=sys.stderr)
    if writer is None:
        return
    try:
        for record in records:
            writer.add_scalar(f"eval/{record.task}/{record.metric}", record.value, step)
    finally:
        writer.close()


def _first_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0].strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
