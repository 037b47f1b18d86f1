"""A plan as text (the ladder, the chosen layout and its memory, the overrides line, warnings)
or as one JSON object (the schema is in docs/plan.md); nothing here decides anything."""

from __future__ import annotations

from goodput.io import json_text
from goodput.plan.ladder import Attempt, Plan
from goodput.plan.memory import GIB, RUNTIME_FRACTION, Breakdown

TERMS = {
    "state": "state (weights, gradients, optimizer)",
    "gathered": "gathered weights (FSDP, compute dtype)",
    "held_gradients": "unsharded gradients held (accumulation)",
    "activations": "activations saved for backward",
    "logits": "logits and loss",
    "runtime": f"runtime allowance ({RUNTIME_FRACTION:.0%} of the device)",
}


def overrides(plan: Plan) -> str:
    """The chosen layout as ``goodput train`` overrides: the six degrees, then each setting
    the estimate assumed that is not the trainer's default."""
    assert plan.chosen is not None and plan.chosen.layout is not None
    line = plan.chosen.layout.overrides()
    if plan.chosen.sync_every_micro_batch:
        line += " parallel.sync_every_micro_batch=true"
    if plan.work.activation_checkpointing:
        line += " parallel.activation_checkpointing=true"
    if plan.work.precision != "fp32-master":
        line += f" parallel.precision={plan.work.precision}"
    return line


def format_text(plan: Plan, title: str) -> str:
    """The plan for a terminal; ``title`` names the config."""
    machine, work = plan.machine, plan.work
    lines = [
        f"plan: {title} on {machine.nodes} node(s) x {machine.gpus_per_node} devices = "
        f"{machine.world} of {machine.gpu_mem_gib:.1f} GiB",
        f"  global batch {work.global_batch_samples * work.seq_len:,} tokens = "
        f"{work.global_batch_samples} x {work.seq_len}; micro-batch {work.micro_batch_size}; "
        f"{work.precision}; activation checkpointing "
        f"{'on' if work.activation_checkpointing else 'off'}",
        "ladder:",
        *(f"  {_attempt_line(attempt)}" for attempt in plan.attempts),
    ]
    chosen = plan.chosen
    if chosen is not None and chosen.layout is not None and chosen.breakdown is not None:
        lines += _chosen_lines(plan, chosen, chosen.breakdown)
    lines += [f"warning: {warning}" for warning in plan.warnings]
    return "\n".join(lines)


def to_json(plan: Plan) -> str:
    """The plan as one JSON object."""
    chosen = plan.chosen
    assert chosen is not None and chosen.layout is not None and chosen.breakdown is not None
    record = {
        "layout": chosen.layout.degrees(),
        "rung": chosen.rung,
        "memory_gib_per_device": _gib(chosen.breakdown.total),
        "device_gib": plan.machine.gpu_mem_gib,
        "breakdown_gib": {name: round(value, 4) for name, value in chosen.breakdown.gib().items()},
        "stage": chosen.breakdown.stage,
        "accumulation": plan.work.accumulation(chosen.layout),
        "sync_every_micro_batch": chosen.sync_every_micro_batch,
        "rejected": [_rejected(attempt) for attempt in plan.rejected],
        "warnings": list(plan.warnings),
        "overrides": overrides(plan),
    }
    return json_text(record, where="goodput plan layout --json", indent=2)


def _attempt_line(attempt: Attempt) -> str:
    layout = f" {attempt.layout.describe()}" if attempt.layout is not None else ""
    if attempt.fits:
        assert attempt.breakdown is not None
        return (
            f"{attempt.rung:<5}{layout}: fits: {attempt.breakdown.total / GIB:.1f} GiB per device"
        )
    return f"{attempt.rung:<5}{layout}: {attempt.reason}"


def _chosen_lines(plan: Plan, chosen: Attempt, breakdown: Breakdown) -> list[str]:
    assert chosen.layout is not None
    accumulation = plan.work.accumulation(chosen.layout)
    stage = f", pipeline stage {breakdown.stage}" if chosen.layout.pp > 1 else ""
    lines = [
        f"chosen: {chosen.rung} {chosen.layout.describe()}: {breakdown.total / GIB:.1f} GiB per "
        f"device of {plan.machine.gpu_mem_gib:.1f} GiB ({accumulation} micro-batch(es) of "
        f"{plan.work.micro_batch_size} per data-parallel rank and step{stage})",
    ]
    lines += [f"  {TERMS[name]:<42}{value:9.2f} GiB" for name, value in breakdown.gib().items()]
    if chosen.sync_every_micro_batch:
        lines.append(
            "note: parallel.sync_every_micro_batch=true: FSDP reduces the gradients after every "
            "micro-batch instead of holding them unsharded through the accumulation, without "
            "which this layout does not fit"
        )
    lines.append(f"overrides: {overrides(plan)}")
    return lines


def _rejected(attempt: Attempt) -> dict[str, object]:
    return {
        "rung": attempt.rung,
        "layout": attempt.layout.degrees() if attempt.layout is not None else None,
        "memory_gib_per_device": (
            _gib(attempt.breakdown.total) if attempt.breakdown is not None else None
        ),
        "reason": attempt.reason,
    }


def _gib(value: float) -> float:
    return round(value / GIB, 4)
