"""Resuming: pick the checkpoint, check it belongs to this run, load it at any DP size.

``auto`` takes the newest directory with ``.complete`` whose files are all there at their
recorded sizes; every newer one it passes over (incomplete, or complete but damaged) is named
in a warning, never skipped silently. ``never`` starts fresh. A path must be a complete
checkpoint, or it is an error.

Before any tensor is read: the model shape must equal the checkpoint's (a different shape is
another run), and the data fingerprint must match unless ``allow_data_change``. Differences in
the rest of the config are printed, since a resumed run with another LR is legitimate but should
never be a surprise. DCP reshards on read, so a checkpoint saved at one DP size loads at another;
each rank's RNG state is restored when the world size is the one it was saved at.

Progress: the bytes of tensors read into this rank's state, against their total, reported by
rank 0 (or the one process of an offline load): a bar on a terminal for ``goodput ckpt`` and
``goodput eval``, plain lines for the trainer (``live=False``).
"""

from __future__ import annotations

import io
import math
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor

from goodput.argtypes import MAX_COUNT
from goodput.checkpoint.metadata import MetadataReader, files_and_sizes, read_metadata
from goodput.checkpoint.parts import load_into
from goodput.checkpoint.state import CheckpointContents, set_rng_state
from goodput.data import schema
from goodput.errors import GoodputError
from goodput.io import is_complete, is_folder, json_type_name, read_json, read_text
from goodput.progress import BYTES, Progress
from goodput.rundir import CONFIG, TRAIN_STATE, list_checkpoints, rng_file

MAX_STEP = 2**40  # far past any run's steps (and its skipped ones)
MAX_WORLD = 1 << 24  # ranks of one job


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, minus unpickling: DCP stores non-tensor values as pickles and would load
    them with ``weights_only=False``, i.e. run whatever a checkpoint file says. goodput never
    writes such values, so one found in a checkpoint is refused. A tensor the model has and the
    checkpoint lacks (a model whose parameters were renamed since) is refused by name. Each
    tensor read advances ``progress`` by its bytes."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def create_local_plan(self) -> Any:
        assert self.metadata is not None
        missing = [
            name for name in self.state_dict if name not in self.metadata.state_dict_metadata
        ]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise GoodputError(
                missing[0],
                f"this model's tensor is not in the checkpoint{more}: it was saved by a model "
                "with other parameter names (e.g. MoE experts before they were grouped)",
                "resume from a checkpoint of this model, or start fresh (checkpoint.resume = "
                "'never', or another run directory)",
            )
        return super().create_local_plan()

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self.progress.advance(tensor.numel() * tensor.element_size())

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise GoodputError(
            read_item.dest_index.fqn,
            "the checkpoint holds a pickled object, which goodput never writes and never loads",
            "use a checkpoint written by goodput, or convert the weights with goodput ckpt",
        )


def load_tensors(
    state: dict[str, Any], directory: Path, *, no_dist: bool = False, live: bool = True
) -> None:
    """``dcp.load`` of tensors only, with metadata from goodput's allow-listing reader; a
    refusal surfaces as its own one-line error rather than inside DCP's per-rank report.
    ``live``: a progress bar on a terminal (False: plain lines, for the trainer)."""
    reader = MetadataReader(directory, read_metadata(directory))
    show = no_dist or dist.get_rank() == 0
    try:
        with Progress(
            f"checkpoint load {directory}",
            total=_local_bytes(state),
            unit=BYTES,
            show=show,
            live=live,
        ) as progress:
            planner = TensorsOnlyLoadPlanner(progress)
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as exc:
        for error, _trace in exc.failures.values():
            if isinstance(error, GoodputError):
                raise GoodputError(directory, f"{error.where}: {error.what}", error.fix) from None
        raise


def _local_bytes(value: Any) -> int:
    """The bytes of this rank's part of every tensor in a (nested) state dict."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_local_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_local_bytes(item) for item in value)
    return 0


def find_checkpoint(root: Path, resume: str, refused: Collection[Path] = ()) -> Path | None:
    """The checkpoint directory to resume from, or None to start fresh; ``auto`` passes over
    the ``refused`` ones (their checksums did not match)."""
    if resume == "never":
        return None
    if resume != "auto":
        directory = Path(resume)
        problem = checkpoint_problem(directory)
        if problem:
            raise GoodputError(
                directory, problem, "pass a complete checkpoint directory, or --resume auto"
            )
        return directory
    for checkpoint in reversed(list_checkpoints(root)):
        if checkpoint.path in refused:
            continue
        problem = checkpoint_problem(checkpoint.path)
        if problem is None:
            return checkpoint.path
        print(f"warning: skipping checkpoint {checkpoint.path}: {problem}", flush=True)
    return None


def checkpoint_problem(directory: Path) -> str | None:
    """Why ``directory`` cannot be resumed from, or None. Cheap: metadata and file sizes."""
    try:
        if not is_folder(directory):
            return "no such folder"
    except GoodputError as exc:  # a loop of links, a folder we may not enter
        return f"unreadable ({exc.what})"
    if not is_complete(directory):
        return "incomplete (no .complete marker: the save was interrupted or failed)"
    try:
        check_train_state(read_json(directory / TRAIN_STATE), directory / TRAIN_STATE)
        metadata = read_metadata(directory)
    except GoodputError as exc:
        return f"damaged ({exc.where}: {exc.what})"
    for name, size in files_and_sizes(metadata).items():
        path = directory / name
        if not path.is_file() or path.stat().st_size < size:
            return f"damaged ({name} is missing or shorter than recorded)"
    return None


def load_checkpoint(
    directory: Path,
    contents: CheckpointContents,
    train_state: dict[str, Any],
    device: torch.device,
) -> None:
    """Load ``directory`` into ``contents``: its ``train_state`` (read from there) into the
    registered parts, before any tensor is read, then the model parts and their optimizers
    (only the model for a model-only checkpoint, as ``goodput ckpt import`` writes), and
    this rank's RNG state when the world size is the one it was saved at."""
    contents.load_train_state(train_state, directory / TRAIN_STATE)
    model_only = bool(train_state.get("model_only"))
    saved_groups = None if model_only else train_state["optimizer_param_groups"]
    load_into(
        contents.parts,
        contents.optimizers,
        lambda state: load_tensors(state, directory, live=False),
        saved_groups,
        directory / TRAIN_STATE,
    )
    if model_only:
        return
    rank_file = rng_file(directory, dist.get_rank())
    if train_state.get("world_size") == dist.get_world_size() and rank_file.is_file():
        set_rng_state(read_json(rank_file), device, rank_file)


def load_model_weights(directory: Path, parts: list[nn.Module]) -> None:
    """Load only the model tensors of ``directory`` into this rank's ``parts`` (sharded or not,
    each tensor cast to its part's dtype): for inference. No optimizer, RNG or loader state is
    read."""
    source = directory / TRAIN_STATE
    load_into(parts, None, lambda state: load_tensors(state, directory), None, source)


def read_checkpoint(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the saved config, the train state) of a checkpoint directory, both checked as data."""
    path = directory / CONFIG
    try:
        saved = tomllib.loads(read_text(path))
    except tomllib.TOMLDecodeError as exc:
        raise _damaged(path, f"invalid TOML ({exc})") from None
    return saved, check_train_state(read_json(directory / TRAIN_STATE), directory / TRAIN_STATE)


def check_train_state(state: Any, path: Path) -> dict[str, Any]:
    """``state`` if it is, whole, the train state goodput writes (``train_state.json``, a memory
    snapshot's manifest: the one checker of both); else one line naming ``path`` and the key.

    Every key the checkpointer writes, of its type and in its range: the step, and unless
    model-only the world size, the loader's position (``schema.check_loader_state``), the
    skipped-step counts, the optimizer's hyper-parameters (each group's parameter names, and
    finite non-negative numbers: no optimizer takes a negative one) and the LR reference. The
    registered parts' own entries (diagnostics, the eval gate) and what depends on the run (the
    loader position within its blend, the groups against its optimizers) are checked by
    ``CheckpointContents.load_train_state`` before anything is loaded into the run. Keys it
    does not know are passed over, as the data manifests' are: a newer writer may add some.
    """
    if not isinstance(state, dict):
        raise _damaged(path, f"is {json_type_name(state)}, not a JSON object")
    _check_count(state, "step", path, MAX_STEP)
    model_only = state.get("model_only", False)
    if type(model_only) is not bool:
        raise _damaged(path, f"model_only = {brief(model_only)} is not true or false")
    if model_only:
        return state
    _check_count(state, "world_size", path, MAX_WORLD, low=1)
    try:
        schema.check_loader_state(path, state.get("loader"))
    except GoodputError as error:  # the data schema's wording, a checkpoint's fix
        raise _damaged(path, error.what) from None
    # The non-finite guard's counts (train.step.SkippedSteps); absent before it existed.
    total = _check_count(state, "skipped_steps", path, MAX_STEP, default=0)
    in_a_row = _check_count(state, "skipped_in_a_row", path, MAX_STEP, default=0)
    if in_a_row > total:
        raise _damaged(path, f"skipped_in_a_row = {in_a_row} is more than skipped_steps = {total}")
    groups = state.get("optimizer_param_groups")
    if not isinstance(groups, list):
        raise _damaged(path, f"optimizer_param_groups = {brief(groups)} is not a list")
    for index, group in enumerate(groups):
        _check_param_group(group, f"optimizer_param_groups[{index}]", path)
    # The loop's LR reference (train.optim.lr_scale); absent before it existed.
    _check_count(state, "lr_reference_tokens", path, MAX_COUNT, low=1, default=1)
    return state


def _check_count(
    state: dict[str, Any], key: str, path: Path, high: int, *, low: int = 0, default: Any = None
) -> int:
    """``state[key]``, a whole number in [``low``, ``high``]; ``default`` when it is absent
    (None: it must be there)."""
    if key not in state and default is not None:
        return int(default)
    if key not in state:
        raise _damaged(path, f"{key} is missing")
    value = state[key]
    if type(value) is not int or not low <= value <= high:
        raise _damaged(path, f"{key} = {brief(value)} is not a whole number in [{low}, {high:,}]")
    return value


def _check_param_group(group: Any, key: str, path: Path) -> None:
    """One saved optimizer parameter group: its parameters' names, and hyper-parameters that
    are true/false, a name, null, or finite numbers >= 0 (alone or in a list, as betas)."""
    if not isinstance(group, dict):
        raise _damaged(path, f"{key} = {brief(group)} is not an object")
    names = group.get("params")
    if not (
        isinstance(names, list)
        and all(isinstance(name, str) for name in names)
        and len(set(names)) == len(names)
    ):
        raise _damaged(path, f"{key}.params = {brief(names)} is not a list of distinct names")
    for name, value in group.items():
        if name != "params" and not (
            _is_hyper_parameter(value)
            or (isinstance(value, list) and all(_is_hyper_parameter(v) for v in value))
        ):
            raise _damaged(
                path,
                f"{key}.{name} = {brief(value)} is not a hyper-parameter (a finite number >= 0, "
                "true/false, a name or null)",
            )


def _is_hyper_parameter(value: Any) -> bool:
    if type(value) in (int, float):
        return math.isfinite(value) and value >= 0
    return value is None or isinstance(value, bool | str)


def brief(value: Any) -> str:
    """``value``'s repr, cut to about 80 characters for a message."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...{text[-12:]}"


def _damaged(path: Path, what: str) -> GoodputError:
    return GoodputError(path, what, "resume from another checkpoint (--resume)")


def config_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: old -> new`` for every leaf that differs, dotted keys, sorted."""
    lines = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            lines.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return lines


def check_model_shape(directory: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a checkpoint whose ``[model]`` table differs from this run's."""
    differences = config_diff(saved.get("model", {}), current["model"], "model.")
    if differences:
        raise GoodputError.usage(
            directory,
            f"the checkpoint's model differs from this config's ({'; '.join(differences)})",
            "resume with the model config the checkpoint was saved with, or start a new run",
        )
