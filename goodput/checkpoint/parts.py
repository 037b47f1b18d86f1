"""A rank's model parts and their optimizers, as the tensors of one checkpoint, by name.

A rank holds one part (the whole model, however sharded) or, under pipeline parallelism, one per
stage it runs (``goodput.train.parallel.pipeline``). Every part names its parameters as the whole
model does, so the parts of all ranks together name each parameter once, and their state dicts merge
into one: model tensors by parameter name, optimizer state by parameter name. A checkpoint
therefore looks the same whatever layout saved it, and DCP reshards it into any other.

The optimizer's hyper-parameters (its param groups) travel in ``train_state.json``; each part
keeps its own parameter lists on load, taking only the hyper-parameters from the file, so a
group saved by a rank that held some stages loads into a rank that holds others.

One name is moved. With tied embeddings a whole model's optimizer names the tied weight's state
``embedding.weight``; a pipeline's last stage holds its own copy of that weight as
``output.weight`` (kept equal to the first stage's), and its state is saved and read under the
whole model's name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from goodput.errors import GoodputError


def _renames(part: nn.Module) -> dict[str, str]:
    """Optimizer-state names of ``part`` that differ from the whole model's."""
    cfg = getattr(part, "cfg", None)
    tied_copy = (
        cfg is not None
        and cfg.tie_embeddings
        and getattr(part, "embedding", None) is None
        and getattr(part, "output", None) is not None
    )
    return {"output.weight": "embedding.weight"} if tied_copy else {}


def _part_states(
    parts: list[nn.Module], optimizers: list[torch.optim.Optimizer] | None
) -> Iterator[tuple[dict[str, Any], dict[str, Any], dict[str, str]]]:
    """Each part's (model state, optimizer state, renames); None: no optimizers, the model's
    state alone."""
    for index, part in enumerate(parts):
        model_state, optimizer_state = get_state_dict(
            part, [] if optimizers is None else optimizers[index]
        )
        yield model_state, optimizer_state, _renames(part)


def gather(
    parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(model tensors, optimizer state, param groups) of this rank's parts, merged."""
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for model_state, optimizer_state, renames in _part_states(parts, optimizers):
        model.update(model_state)
        optim.update({renames.get(k, k): v for k, v in optimizer_state["state"].items()})
        for index, group in enumerate(optimizer_state["param_groups"]):
            names = [renames.get(name, name) for name in group["params"]]
            if index == len(groups):
                groups.append({**group, "params": names})
            else:  # a tied weight's copy is already there under its whole-model name
                known = set(groups[index]["params"])
                groups[index]["params"] += [name for name in names if name not in known]
    return model, optim, groups


def check_param_groups(
    optimizers: list[torch.optim.Optimizer], saved_groups: list[dict[str, Any]], source: Path
) -> None:
    """Refuse, naming ``source`` and the key, saved hyper-parameters (``train_state.json``'s
    ``optimizer_param_groups``, checked as data) that this run's optimizers cannot take: as many
    groups as each has, and every hyper-parameter of theirs that the file holds of the same
    kind (a number, true/false, a name, null, a list as long). A value of another kind would
    fail inside the optimizer's step, after the tensors were loaded. One the file lacks (saved
    by an older torch) keeps this run's value (``load_into``); keys only the file has are left
    to the optimizer, as torch's ``load_state_dict`` leaves them."""
    fix = "resume with the [optim] config the checkpoint was saved with, or another checkpoint"
    for optimizer in optimizers:
        own_groups = optimizer.param_groups
        if len(own_groups) != len(saved_groups):
            raise GoodputError(
                source,
                f"holds {len(saved_groups)} optimizer parameter groups, this run has "
                f"{len(own_groups)}",
                fix,
            )
        for index, (own, saved) in enumerate(zip(own_groups, saved_groups, strict=True)):
            for key, value in own.items():
                if key != "params" and key in saved and _kind(saved[key]) != _kind(value):
                    raise GoodputError(
                        source,
                        f"optimizer_param_groups[{index}].{key} is {_kind(saved[key])}, this "
                        f"run's optimizer holds {_kind(value)}",
                        fix,
                    )


def _kind(value: Any) -> str:
    """What a hyper-parameter is, in words: ints and floats are both numbers."""
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}: {', '.join(_kind(item) for item in value)}"
    return "a name" if isinstance(value, str) else "null" if value is None else type(value).__name__


def load_into(
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer] | None,
    load: Any,
    saved_groups: list[dict[str, Any]] | None,
    source: Path,
) -> None:
    """Fill ``parts`` (and, unless ``saved_groups`` is None, their optimizers: one per part, or
    None for a model without any) by calling ``load(state)`` once on the merged request
    ``{"model": ..., "optim": ...}``, which fills its tensors in place."""
    assert optimizers is not None or saved_groups is None, "optimizer state needs optimizers"
    states = list(_part_states(parts, optimizers))
    request: dict[str, Any] = {"model": {}}
    for model_state, _, _ in states:
        request["model"].update(model_state)
    if saved_groups is not None:
        request["optim"] = {}
        for _, optimizer_state, renames in states:
            request["optim"].update(
                {renames.get(k, k): v for k, v in optimizer_state["state"].items()}
            )
    load(request)
    for index, (part, (model_state, optimizer_state, renames)) in enumerate(
        zip(parts, states, strict=True)
    ):
        model_state = {name: request["model"][name] for name in model_state}
        if saved_groups is None or optimizers is None:
            set_model_state_dict(part, model_state)
            continue
        optimizer = optimizers[index]
        own_groups = optimizer_state["param_groups"]  # as many as saved: check_param_groups
        optimizer_state = {
            "state": {k: request["optim"][renames.get(k, k)] for k in optimizer_state["state"]},
            "param_groups": [
                {**own, **saved, "params": own["params"]}
                for saved, own in zip(saved_groups, own_groups, strict=True)
            ],
        }
        set_state_dict(
            part, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state
        )
