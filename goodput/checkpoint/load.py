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

from goodput.checkpoint.metadata import MetadataReader, files_and_sizes, read_metadata
from goodput.checkpoint.parts import load_into
from goodput.checkpoint.state import CheckpointContents, set_rng_state
from goodput.errors import GoodputError
from goodput.io import is_complete, is_folder, read_json, read_text
from goodput.progress import BYTES, Progress
from goodput.rundir import CONFIG, TRAIN_STATE, list_checkpoints, rng_file


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
    (only the model for a model-only checkpoint, as ``goodput ckpt import-hf`` writes), and
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
    """``state`` if it has the shape goodput writes: a step, and unless model-only the world
    size, the loader position, the skipped-step count and the optimizer's hyper-parameters as
    JSON scalars."""
    if not isinstance(state, dict) or not _is_count(state.get("step")):
        raise _damaged(path, "no step count")
    if state.get("model_only") is True:
        return state
    loader = state.get("loader")
    if not (
        isinstance(loader, dict)
        and _is_count(loader.get("consumed_samples"))
        and isinstance(loader.get("fingerprint"), str)
    ):
        raise _damaged(path, "no loader position (consumed_samples, fingerprint)")
    if not _is_count(state.get("world_size")) or state["world_size"] < 1:
        raise _damaged(path, "no world_size")
    # The non-finite guard's count (train.step.SkippedSteps); absent before it existed.
    skips = [state.get(key, 0) for key in ("skipped_steps", "skipped_in_a_row")]
    if not all(_is_count(count) for count in skips) or skips[1] > skips[0]:
        raise _damaged(path, "skipped_steps and skipped_in_a_row are not two counts, in order")
    groups = state.get("optimizer_param_groups")
    if not isinstance(groups, list) or not all(_is_param_group(g) for g in groups):
        raise _damaged(path, "optimizer_param_groups is not a list of hyper-parameter tables")
    # The loop's LR reference (train.watch; its diagnostics' states are checked there); absent
    # before it existed.
    reference = state.get("lr_reference_tokens", 1)
    if not _is_count(reference) or reference < 1:
        raise _damaged(path, "lr_reference_tokens is not a positive count of tokens")
    return state


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _is_param_group(group: Any) -> bool:
    def scalar(value: Any) -> bool:
        if isinstance(value, float):
            return math.isfinite(value)
        return value is None or isinstance(value, bool | int | str)

    return isinstance(group, dict) and all(
        scalar(v) or (isinstance(v, list) and all(scalar(x) for x in v)) for v in group.values()
    )


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
