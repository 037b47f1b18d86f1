"""The data of lm-eval tasks, where ``goodput eval`` hands it to lm-eval and Hugging Face
``datasets``: a failure names the task, its task file and its data file (at the first bad line
where that can be told), never a bare ``DatasetGenerationError``.

lm-eval builds each task (``ConfigurableTask``): its constructor passes the task's
``dataset_path`` and ``dataset_kwargs`` to ``datasets.load_dataset`` and iterates the documents;
later it builds the prompts from them (``build_all_requests``: the task file's templates and
functions on each document). What either raises names neither the task nor the file.
``naming_task_data`` wraps both on lm-eval's class while goodput eval loads and runs tasks:

- before a task is built, every local file of its ``dataset_kwargs.data_files`` (a path, a
  list, or a mapping of split to path or list; glob patterns expanded; URLs left to
  ``datasets``) must exist and be a regular file (``datasets`` would block forever on a FIFO);
- when building it fails, the files of a ``dataset_path: json`` task are read back strictly to find
  the first line that is not UTF-8 or not a JSON object (a file opening with ``[`` is one JSON
  array, as ``datasets`` reads it), named as ``FILE:LINE``; any other failure names the task,
  its task file and its data files, with the library's first line and its cause's;
- a failure to build prompts names the task and its task file, with the library's line.

It does not read data for lm-eval (``datasets`` does), nor task files (``lm_eval_tasks``).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from goodput.errors import GoodputError
from goodput.io import SMALL_FILE_BYTES, open_regular, require_regular

MAX_CHECKED_LINE_BYTES = 64 << 20  # a longer line ends the search for the bad one
MAX_CAUSES = 16  # how deep a chain of causes is followed
UTF8_BOM = b"\xef\xbb\xbf"
DATA_FIX = (
    "fix that data file or the task file's dataset_kwargs.data_files (a relative path is "
    "relative to the working directory); a JSON Lines file holds one JSON object per line"
)


@contextlib.contextmanager
def naming_task_data() -> Iterator[None]:
    """While tasks load and build their requests: their data files checked, and a failure to
    read them or to build prompts from them named (see the module docstring)."""
    from lm_eval.api.task import ConfigurableTask

    init, build_all_requests = ConfigurableTask.__init__, ConfigurableTask.build_all_requests

    def checked_init(task: Any, *args: Any, config: Any = None, **kwargs: Any) -> None:
        files = local_data_files(config)
        try:  # reads the data set, then iterates its documents
            init(task, *args, config=config, **kwargs)
        except GoodputError:
            raise
        except Exception as error:
            raise data_error(config, files, error) from error

    def named_build_all_requests(task: Any, **kwargs: Any) -> None:
        try:
            build_all_requests(task, **kwargs)
        except GoodputError:
            raise
        except Exception as error:
            raise GoodputError(
                _task(task.config),
                f"could not build its prompts from its data: {_chain(error)}",
                "fix the task file's doc_to_text, doc_to_target, doc_to_choice or process_docs "
                "for its data (task files are code: docs/evals.md)",
            ) from error

    with (
        _replaced(ConfigurableTask, "__init__", checked_init),
        _replaced(ConfigurableTask, "build_all_requests", named_build_all_requests),
    ):
        yield


@contextlib.contextmanager
def _replaced(cls: type, name: str, function: Any) -> Iterator[None]:
    """``cls.name`` is ``function`` inside; after, the class is as it was (an inherited method
    is inherited again)."""
    own = name in vars(cls)
    before = vars(cls).get(name)
    setattr(cls, name, function)
    try:
        yield
    finally:
        if own:
            setattr(cls, name, before)
        else:
            delattr(cls, name)


def local_data_files(config: Any) -> list[Path]:
    """The local files of a task's ``data_files``, each checked to be a regular file."""
    kwargs = _setting(config, "dataset_kwargs") or {}
    data_files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    entries = data_files.values() if isinstance(data_files, dict) else [data_files]
    names: list[str] = []
    for entry in entries:
        items = entry if isinstance(entry, list | tuple) else [entry]
        names += [str(item) for item in items if isinstance(item, str | os.PathLike)]
    paths: list[Path] = []
    for name in names:
        if "://" in name:  # hf://, https://: datasets' own, and refused offline by it
            continue
        matches = sorted(glob.glob(name, recursive=True)) if glob.has_magic(name) else [name]
        paths += [Path(match) for match in matches]
    for path in paths:
        try:
            require_regular(path)
        except GoodputError as error:
            raise GoodputError(
                error.where, f"{error.what} (data of {_task(config)})", DATA_FIX
            ) from None
    return paths


def data_error(config: Any, files: list[Path], error: BaseException) -> GoodputError:
    """What ``datasets`` raised on a task's data, as one line naming the file."""
    if _setting(config, "dataset_path") == "json":
        for path in files:
            found = first_bad_json_line(path)
            if found is not None:
                line, what = found
                return GoodputError(f"{path}:{line}", f"{what} (data of {_task(config)})", DATA_FIX)
    named = ", ".join(str(path) for path in files) or "(no local data_files)"
    return GoodputError(
        f"{_task(config)}, data {named}",
        f"could not be loaded: {_chain(error)}",
        "check the task's data is local (data_files that exist, or a data set already in the "
        "Hugging Face cache: goodput eval runs offline) in its dataset_path's format, and the "
        "task file's settings (docs/evals.md)",
    )


def first_bad_json_line(path: Path) -> tuple[int, str] | None:
    """The first line of a JSON data file that ``datasets`` cannot read, and why; None when
    none is found (or the file cannot be searched: too large a line or document)."""
    with open_regular(path) as file:
        start = len(UTF8_BOM) if file.read(len(UTF8_BOM)) == UTF8_BOM else 0  # datasets skips it
        file.seek(start)
        if file.read(1) == b"[":  # one JSON array, as datasets reads it
            file.seek(start)
            return _bad_document(file.read(SMALL_FILE_BYTES + 1))
        file.seek(start)
        number = 0
        while raw := file.readline(MAX_CHECKED_LINE_BYTES + 1):
            number += 1
            if len(raw) > MAX_CHECKED_LINE_BYTES:
                return None
            problem = _bad_line(raw)
            if problem is not None:
                return number, problem
    return None


def _bad_line(raw: bytes) -> str | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"is not UTF-8: byte 0x{raw[error.start]:02x} at column {error.start + 1}"
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return f"is not JSON: {error.msg} at column {error.colno}"
    if not isinstance(value, dict):
        return f"is a JSON {type(value).__name__}, not an object"
    return None


def _bad_document(data: bytes) -> tuple[int, str] | None:
    if len(data) > SMALL_FILE_BYTES:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        return line, f"is not UTF-8: byte 0x{data[error.start]:02x}"
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        return error.lineno, f"is not JSON: {error.msg} at column {error.colno}"
    return None


def _setting(config: Any, key: str) -> Any:
    """A task config's ``key``: lm-eval passes a plain dict to the task, which keeps a
    ``TaskConfig`` (a dict subclass whose settings are attributes)."""
    return config.get(key) if type(config) is dict else getattr(config, key, None)


def _task(config: Any) -> str:
    metadata = _setting(config, "metadata")
    source = metadata.get("config_source") if isinstance(metadata, dict) else None
    name = f"lm-eval task {_setting(config, 'task') or '?'}"
    return f"{name} ({source})" if source and source != "inline" else name


def _chain(error: BaseException) -> str:
    """The error's first line, and its innermost cause's (where the library said what)."""
    cause = error
    for _ in range(MAX_CAUSES):
        inner = cause.__cause__ or cause.__context__
        if inner is None:
            break
        cause = inner
    said = _first_line(error)
    return said if cause is error else f"{said} ({_first_line(cause)})"


def _first_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0].strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
