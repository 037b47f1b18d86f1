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
"""

from __future__ import annotations

import io
import json
import tomllib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from goodput.checkpoint.layout import CONFIG, TRAIN_STATE, list_checkpoints, rng_file
from goodput.checkpoint.state import set_rng_state
from goodput.errors import GoodputError
from goodput.io import is_complete


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, minus unpickling: DCP stores non-tensor values as pickles and would load
    them with ``weights_only=False``, i.e. run whatever a checkpoint file says. goodput never
    writes such values, so one found in a checkpoint is refused."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise GoodputError(
            read_item.dest_index.fqn,
            "the checkpoint holds a pickled object, which goodput never writes and never loads",
            "use a checkpoint written by goodput, or convert the weights with goodput ckpt",
        )


def load_tensors(state: dict[str, Any], directory: Path, *, no_dist: bool = False) -> None:
    """``dcp.load`` of tensors only; a refusal surfaces as its own one-line error rather than
    inside DCP's per-rank exception report."""
    try:
        dcp.load(state, checkpoint_id=directory, planner=TensorsOnlyLoadPlanner(), no_dist=no_dist)
    except CheckpointException as exc:
        for error, _trace in exc.failures.values():
            if isinstance(error, GoodputError):
                raise GoodputError(directory, f"{error.where}: {error.what}", error.fix) from None
        raise


def find_checkpoint(root: Path, resume: str) -> Path | None:
    """The checkpoint directory to resume from, or None to start fresh."""
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
        problem = checkpoint_problem(checkpoint.path)
        if problem is None:
            return checkpoint.path
        print(f"warning: skipping checkpoint {checkpoint.path}: {problem}", flush=True)
    return None


def checkpoint_problem(directory: Path) -> str | None:
    """Why ``directory`` cannot be resumed from, or None. Cheap: metadata and file sizes."""
    if not is_complete(directory):
        return "incomplete (no .complete marker: the save was interrupted or failed)"
    try:
        json.loads((directory / TRAIN_STATE).read_text())
        metadata = FileSystemReader(directory).read_metadata()
    except (OSError, ValueError, RuntimeError, EOFError) as exc:
        return f"damaged ({type(exc).__name__}: {exc})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in needed.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size < size:
            return f"damaged ({name} is missing or shorter than recorded)"
    return None


def load_checkpoint(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    device: torch.device,
) -> None:
    """Load ``directory`` into ``model`` and ``optimizer`` (only the model for a model-only
    checkpoint, as ``goodput ckpt import-hf`` writes), and this rank's RNG state when the world
    size is the one it was saved at."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    if train_state.get("model_only"):
        state: dict[str, Any] = {"model": model_state}
        load_tensors(state, directory)
        set_model_state_dict(model, state["model"])
        return
    state = {"model": model_state, "optim": optimizer_state["state"]}
    load_tensors(state, directory)
    optimizer_state = {
        "state": state["optim"],
        "param_groups": train_state["optimizer_param_groups"],
    }
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=optimizer_state
    )
    rank_file = rng_file(directory, dist.get_rank())
    if train_state.get("world_size") == dist.get_world_size() and rank_file.is_file():
        set_rng_state(json.loads(rank_file.read_text()), device)


def read_checkpoint(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the saved config, the train state) of a checkpoint directory."""
    saved = tomllib.loads((directory / CONFIG).read_text())
    return saved, json.loads((directory / TRAIN_STATE).read_text())


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
