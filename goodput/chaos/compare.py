"""Whether a run ended exactly where its reference did: per-step losses, and the final checkpoint's
weights, optimizer state, RNG states and train state, all compared bit for bit.

Losses: the reference must have run each step once; every run of a step in the other run (a
resumed run repeats the steps after its checkpoint) must have its loss, bit for bit (a loss the
trainer logged as null, not finite, equals only a null). Checkpoints: the
complete checkpoint of the last step of each run, its files verified against ``checksums.json``
first (a damaged one is an error, not a difference), its tensors read through goodput's
allow-listing metadata reader into plain CPU tensors, model and optimizer one after the other to
halve the peak memory; two tensors are equal when they have the same name, dtype, shape and
bytes. RNG states are each rank's JSON file; the train state is ``train_state.json`` (step,
loader position, skipped steps, optimizer hyper-parameters, the LR reference and the loop's
diagnostics, which a resumed run must carry on exactly). The config is not compared: the run
directories differ by design.

Each part reports its first difference in one line (the tensor and element with both values,
the step with both losses, the generator with its rank), or None when it is equal.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from goodput import rundir
from goodput.checkpoint.checksums import first_mismatch, read_checksums
from goodput.checkpoint.load import load_tensors
from goodput.checkpoint.metadata import read_metadata
from goodput.errors import GoodputError
from goodput.io import is_complete, read_json
from goodput.report.run_files import Step

PARTS = ("losses", "weights", "optimizer", "rng", "train_state")
STATE_PREFIXES = {"weights": "model.", "optimizer": "optim."}  # DCP names: {"model", "optim"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """The first difference of each part, or None where it is bitwise equal."""

    losses: str | None
    weights: str | None
    optimizer: str | None
    rng: str | None
    train_state: str | None

    @property
    def equal(self) -> bool:
        return self.first_difference is None

    @property
    def first_difference(self) -> str | None:
        for part in PARTS:
            difference = getattr(self, part)
            if difference is not None:
                return f"{part}: {difference}"
        return None


def compare_losses(reference: list[Step], other: list[Step], num_steps: int) -> str | None:
    """The first step (in the other run's order) whose loss differs from the reference's; the
    step records as ``report.run_files`` reads them, every line in file order."""
    expected: dict[int, float | None] = {}
    for record in reference:
        if record.step in expected:
            return f"the reference ran step {record.step} twice"
        expected[record.step] = _loss(record)
    for runs, name in ((expected, "the reference"), ({r.step for r in other}, "the faulted run")):
        missing = sorted(set(range(1, num_steps + 1)) - set(runs))
        if missing:
            return f"{name} has no loss of step {missing[0]}"
    for record in other:
        if record.step not in expected:
            return f"the faulted run has a step {record.step} the reference never ran"
        loss, reference_loss = _loss(record), expected[record.step]
        if _bits(loss) != _bits(reference_loss):
            return f"step {record.step}: {loss!r} against the reference's {reference_loss!r}"
    return None


def _loss(record: Step) -> float | None:
    """The step's loss; None where the trainer wrote null (not finite): ``values`` holds only
    the line's finite numbers."""
    return record.values.get("loss")


def _bits(value: float | None) -> bytes:
    """The loss as compared: its float64 bytes (-0.0 is not 0.0); a non-finite loss the trainer
    wrote as null compares equal only to another null."""
    return b"null" if value is None else struct.pack("<d", value)


def final_checkpoint(run_dir: Path, num_steps: int) -> Path:
    """The complete checkpoint of the run's last step, its files checked against its checksums."""
    directory = rundir.step_dir(rundir.checkpoints_dir(run_dir), num_steps)
    if not is_complete(directory):
        raise GoodputError(
            directory,
            "is not a complete checkpoint: the run did not save its last step",
            "see the run's launch.log; the campaign compares the final checkpoints",
        )
    digests = read_checksums(directory)
    problem = first_mismatch(directory, digests) if digests is not None else "no checksums.json"
    if problem:
        raise GoodputError(directory, f"damaged: {problem}", "rerun the campaign in a new folder")
    return directory


def compare_checkpoints(reference: Path, other: Path) -> dict[str, str | None]:
    """The first difference of the weights, optimizer state, RNG states and train state."""
    found = {
        part: _compare_tensors(reference, other, prefix) for part, prefix in STATE_PREFIXES.items()
    }
    found["rng"] = _compare_rng(reference, other)
    found["train_state"] = _first_json_difference(
        read_json(reference / rundir.TRAIN_STATE), read_json(other / rundir.TRAIN_STATE), ""
    )
    return found


def _compare_tensors(reference: Path, other: Path, prefix: str) -> str | None:
    ours, theirs = _tensors(reference, prefix), _tensors(other, prefix)
    if ours.keys() != theirs.keys():
        name = sorted(ours.keys() ^ theirs.keys())[0]
        return f"{name} is in only one of the checkpoints"
    for name, tensor in ours.items():
        difference = tensor_difference(tensor, theirs[name])
        if difference is not None:
            return f"{name}: {difference}"
    return None


def tensor_difference(reference: torch.Tensor, other: torch.Tensor) -> str | None:
    """Where two tensors differ, bit for bit (dtype, shape, then the first element), or None."""
    if reference.dtype != other.dtype or reference.shape != other.shape:
        return (
            f"{other.dtype} {tuple(other.shape)} against the reference's {reference.dtype} "
            f"{tuple(reference.shape)}"
        )
    ours, theirs = _as_bytes(reference), _as_bytes(other)
    if torch.equal(ours, theirs):
        return None
    item_size = reference.element_size()
    first_byte = int(torch.nonzero(ours != theirs)[0].item())
    index = first_byte // item_size
    flat_reference, flat_other = reference.reshape(-1), other.reshape(-1)
    position = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), reference.shape))
    return (
        f"element {position}: {flat_other[index].item()!r} against the reference's "
        f"{flat_reference[index].item()!r}"
    )


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _tensors(directory: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint whose DCP name starts with ``prefix``, as a CPU tensor."""
    metadata = read_metadata(directory).state_dict_metadata
    state = {
        name: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for name, entry in metadata.items()
        if name.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }
    with _single_process_read():
        load_tensors(state, directory, no_dist=True)
    return state


@contextmanager
def _single_process_read() -> Iterator[None]:
    # DCP warns that it assumes one process when no process group exists: here, by design.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _compare_rng(reference: Path, other: Path) -> str | None:
    names = _rng_files(reference), _rng_files(other)
    if names[0] != names[1]:
        name = sorted(names[0] ^ names[1])[0]
        return f"{rundir.RNG_DIR}/{name} is in only one of the checkpoints"
    for name in sorted(names[0]):
        ours = read_json(reference / rundir.RNG_DIR / name)
        theirs = read_json(other / rundir.RNG_DIR / name)
        difference = _first_json_difference(ours, theirs, "")
        if difference is not None:
            return f"{name}: {difference}"
    return None


def _rng_files(directory: Path) -> set[str]:
    folder = directory / rundir.RNG_DIR
    return {path.name for path in folder.iterdir()} if folder.is_dir() else set()


def _first_json_difference(reference: Any, other: Any, where: str) -> str | None:
    """The first key path where two JSON values differ (the generator's name for an RNG state)."""
    if isinstance(reference, dict) and isinstance(other, dict):
        for key in sorted(reference.keys() | other.keys()):
            if key not in reference or key not in other:
                return f"{where}{key} is in only one of them"
            found = _first_json_difference(reference[key], other[key], f"{where}{key}.")
            if found is not None:
                return found
        return None
    if reference == other:
        return None
    return f"{where.rstrip('.') or 'the value'} differs"
