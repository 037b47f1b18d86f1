"""A plan as text (one screen: the cheapest candidates and their costs, the closest rejection of
each rung, the chosen layout's memory, its margin over the config's own [parallel], the
overrides line, warnings) or as one JSON object (the schema is in docs/plan.md); nothing here
decides anything."""

from __future__ import annotations

import math
from typing import Any

from goodput.io import json_text
from goodput.plan.cost import Rates
from goodput.plan.ladder import RUNGS, TIE, Candidate, Plan
from goodput.plan.layout import FP8_RECIPES, Layout
from goodput.plan.memory import GIB, RUNTIME_FRACTION, Breakdown

TABLE_ROWS = 8  # the cheapest candidates shown; --json has them all
TERMS = {
    "state": "state (weights, gradients, optimizer)",
    "gathered": "gathered weights (FSDP, compute dtype)",
    "held_gradients": "unsharded gradients held (accumulation)",
    "activations": "activations saved for backward",
    "logits": "logits and loss",
    "runtime": f"runtime allowance ({RUNTIME_FRACTION:.0%} of the device)",
}
CONFIG = "config"  # the rung shown for the config's own [parallel] (--layout-from-config)


def overrides(plan: Plan, chosen: Candidate) -> str:
    """The chosen layout as ``goodput train`` overrides: its [parallel] keys, then each setting
    the estimate assumed that is not the trainer's default."""
    assert chosen.layout is not None
    line = chosen.layout.overrides()
    if chosen.sync_every_micro_batch:
        line += " parallel.sync_every_micro_batch=true"
    if plan.work.precision != "fp32-master":
        line += f" parallel.precision={plan.work.precision}"
    return line


def format_text(
    plan: Plan,
    title: str,
    seq_from: str,
    chosen: Candidate | None = None,
    config: Candidate | None = None,
) -> str:
    """The plan for a terminal; ``title`` names the config, ``seq_from`` where seq_len came
    from; ``chosen``: the layout to report (default the planner's); ``config``: the config's
    own [parallel], evaluated, whose margin against the chosen layout is printed."""
    machine, work, rates = plan.machine, plan.work, plan.rates
    chosen = chosen or plan.chosen
    fitting = plan.fitting
    compute = fitting[0].cost.compute if fitting and fitting[0].cost else None
    lines = [
        f"plan: {title} on {machine.nhosts} host(s) x {machine.ppn} devices = {machine.world} "
        f"of {machine.gpu_mem_gib:.1f} GiB",
        f"  global batch {work.global_batch_samples * work.seq_len:,} tokens = "
        f"{work.global_batch_samples} x {work.seq_len} (seq_len: {seq_from}); micro-batch "
        f"{work.micro_batch_size}; {work.precision}",
        f"  step cost at {rates.flops / 1e12:g} TFLOP/s per device"
        + _speedups(rates)
        + (f" (compute {compute:.3g} s a step in every layout)" if compute else "")
        + f", {rates.intra_bytes / 1e9:g} GB/s per device within a host, "
        f"{rates.inter_bytes / 1e9:g} GB/s between hosts",
        f"candidates: {len(plan.candidates)} tried, {len(fitting)} fit and split the batch"
        + ("; the cheapest of each shape (--json: all):" if fitting else ""),
    ]
    rows = _shapes(fitting)[:TABLE_ROWS]
    if chosen is not None and chosen not in rows:
        rows.append(chosen)
    if rows:
        width = max(len(c.layout.describe()) for c in rows if c.layout) + 2
        digits = _decimals(max(c.cost.total for c in rows if c.cost))
        column = max(9, digits + 4)
        lines.append(
            f"  {'rung':<7}{'layout':<{width}}{'GiB':>6}"
            + "".join(f"{name:>{column}}" for name in ("comm s", "recomp s", "bubble s", "total s"))
        )
        lines += [f"  {_row(candidate, width, digits)}" for candidate in rows]
    lines += _rejected_lines(plan)
    if chosen is not None and chosen.layout is not None and chosen.breakdown is not None:
        lines += _chosen_lines(plan, chosen, chosen.breakdown, config)
    lines += [f"warning: {warning}" for warning in plan.warnings]
    return "\n".join(lines)


def _speedups(rates: Rates) -> str:
    """The fp8 and compile speed-ups the step cost assumes, and the matmuls' size effect."""
    fp8 = ", ".join(
        f"fp8 {recipe} x{gain:g}"
        for recipe in FP8_RECIPES
        if (gain := rates.fp8(recipe)) is not None
    )
    size = f", matmuls at dim / (dim + {rates.gemm_half_dim:g})" if rates.gemm_half_dim else ""
    return f" (linear layers: {fp8 or 'no fp8'}; compile x{rates.compile:g}{size})"


def _margin(config: Candidate, chosen: Candidate) -> str:
    """The config's own layout against the chosen one: how much faster the chosen one steps
    by the estimate (tokens a second: the ratio of the step times), or that they are one."""
    assert config.layout is not None and config.cost is not None and chosen.cost is not None
    if config.layout == chosen.layout:
        return "margin: the config's [parallel] is the chosen layout"
    fit = "" if config.fits else f"; it does not fit: {config.reason}"
    gain = config.cost.total / chosen.cost.total - 1
    than = "faster" if gain >= 0 else "slower"
    return (
        f"margin: the config's [parallel] ({config.layout.describe()}) takes "
        f"{config.cost.total:.4g} s a step: the chosen layout is {abs(gain):.1%} {than} by "
        f"the estimate{fit}"
    )


def to_json(
    plan: Plan,
    seq_from: str,
    chosen: Candidate | None = None,
    error: str | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """The plan as one JSON object (``layout`` null and ``error`` set when nothing fits)."""
    chosen = chosen or plan.chosen
    record: dict[str, Any] = {"layout": None}
    if chosen is not None and chosen.layout is not None and chosen.breakdown is not None:
        layout = chosen.layout
        record = {
            "layout": layout.by_name(),
            "activation_checkpointing": layout.activation_checkpointing,
            "fp8": layout.fp8,
            "compile": layout.compile,
            "pp_schedule": _schedule(layout),
            "pp_layers_per_stage": _layers(layout),
            "rung": chosen.rung,
            "memory_gib_per_device": _gib(chosen.breakdown.total),
            "device_gib": plan.machine.gpu_mem_gib,
            "breakdown_gib": {k: round(v, 4) for k, v in chosen.breakdown.gib().items()},
            "stage": chosen.breakdown.stage,
            "accumulation": plan.work.accumulation(layout),
            "sync_every_micro_batch": chosen.sync_every_micro_batch,
            "cost_s": _seconds(chosen),
        }
    record |= {
        "seq_len": plan.work.seq_len,
        "seq_len_from": seq_from,
        "rates": {
            "tflops": plan.rates.flops / 1e12,
            "intra_gbps": plan.rates.intra_bytes / 1e9,
            "inter_gbps": plan.rates.inter_bytes / 1e9,
            "fp8_rowwise": plan.rates.fp8_rowwise,
            "fp8_tensorwise": plan.rates.fp8_tensorwise,
            "compile": plan.rates.compile,
            "gemm_half_dim": plan.rates.gemm_half_dim,
        },
        "candidates": [_candidate(candidate) for candidate in plan.candidates],
        "nearest_global_batches": [
            {
                "samples": n.samples,
                "tokens": n.samples * plan.work.seq_len,
                "layout": n.layout.by_name(),
                "activation_checkpointing": n.layout.activation_checkpointing,
                "fp8": n.layout.fp8,
                "compile": n.layout.compile,
                "total_s": round(n.total_s, 4),
            }
            for n in plan.nearest
        ],
        "warnings": list(plan.warnings),
    }
    if chosen is not None and chosen.layout is not None:
        record["overrides"] = overrides(plan, chosen)
    if error is not None:
        record["error"] = error
    record |= extra or {}
    return json_text(record, where="goodput plan layout --json", indent=2)


def _shapes(fitting: list[Candidate]) -> list[Candidate]:
    """The cheapest candidate of each shape (its degrees but how data parallelism splits into
    replicas and shards, and checkpointing), cheapest first: the table's rows."""
    seen, rows = set(), []
    for candidate in fitting:
        layout = candidate.layout
        assert layout is not None
        shape = (
            layout.pp,
            layout.tp,
            layout.cp,
            layout.ep,
            layout.activation_checkpointing,
            layout.fp8,
            layout.compile,
        )
        if shape not in seen:
            seen.add(shape)
            rows.append(candidate)
    return rows


def _row(candidate: Candidate, width: int, digits: int) -> str:
    assert candidate.layout is not None and candidate.breakdown is not None
    cost = candidate.cost
    assert cost is not None
    seconds = "".join(
        f"{value:>{max(9, digits + 4)}.{digits}f}"
        for value in (cost.comm, cost.recompute, cost.bubble, cost.total)
    )
    return (
        f"{candidate.rung:<7}{candidate.layout.describe():<{width}}"
        f"{candidate.breakdown.total / GIB:>6.1f}{seconds}"
        + ("" if candidate.fits else "  (does not fit)")
    )


def _decimals(largest: float) -> int:
    """Decimals that show the largest time to 4 significant digits (1 to 8)."""
    if largest <= 0:
        return 3
    return min(8, max(1, 3 - math.floor(math.log10(largest))))


def _rejected_lines(plan: Plan) -> list[str]:
    """Per rung: how many were rejected, and the one with the smallest memory and its reason."""
    lines = []
    for rung in RUNGS:
        tried = [c for c in plan.candidates if c.rung == rung]
        rejected = [c for c in tried if not c.fits]
        if not rejected:
            continue
        estimated = [c for c in rejected if c.breakdown is not None]
        if estimated:
            closest = min(estimated, key=lambda c: c.breakdown.total if c.breakdown else 0.0)
        else:
            closest = rejected[0]
        what = f"{closest.layout.describe()}: " if closest.layout is not None else ""
        lines.append(
            f"  {rung:<7}{len(rejected)} of {len(tried)}, e.g. {what}{_short(plan, closest)}"
        )
    return ["rejected, by rung (how many, and the smallest):", *lines] if lines else []


def _short(plan: Plan, candidate: Candidate) -> str | None:
    """A rejection's reason in a few words (--json has it whole)."""
    if candidate.breakdown is None or candidate.layout is None:
        return candidate.reason
    memory = f"{candidate.breakdown.total / GIB:.1f} GiB"
    if not candidate.fits_memory:
        return f"{memory} > {plan.machine.gpu_mem_gib:.1f} GiB"
    work = plan.work
    if work.global_batch_samples % (candidate.layout.dp * work.micro_batch_size):
        return (
            f"fits in {memory}, but {candidate.layout.dp} data-parallel ranks x micro-batch "
            f"{work.micro_batch_size} do not divide {work.global_batch_samples} samples"
        )
    return candidate.reason  # the pipeline's micro-batches: the trainer's own words


def _chosen_lines(
    plan: Plan, chosen: Candidate, breakdown: Breakdown, config: Candidate | None
) -> list[str]:
    """The chosen layout: its memory term by term, notes, the margin over the config's own
    [parallel] (when given), and the overrides (last, to paste)."""
    assert chosen.layout is not None and chosen.cost is not None
    accumulation = plan.work.accumulation(chosen.layout)
    stage = f", pipeline rank {breakdown.stage}" if chosen.layout.pp > 1 else ""
    lines = [
        f"chosen: {chosen.rung} {chosen.layout.describe()}: {breakdown.total / GIB:.1f} GiB per "
        f"device of {plan.machine.gpu_mem_gib:.1f} GiB ({accumulation} micro-batch(es) of "
        f"{plan.work.micro_batch_size} per data-parallel rank and step{stage}); "
        f"{chosen.cost.total:.4g} s a step: {_why(plan, chosen)}",
    ]
    lines += [f"  {TERMS[name]:<42}{value:9.2f} GiB" for name, value in breakdown.gib().items()]
    if chosen.layout.pp_layers_per_stage is not None:
        lines.append(
            f"note: the {chosen.layout.num_stages} stages hold "
            f"{list(chosen.layout.pp_layers_per_stage)} layers: they do not divide evenly, and "
            "the first and last stages, which hold the embedding and the head, take fewer"
        )
    if chosen.sync_every_micro_batch:
        lines.append(
            "note: parallel.sync_every_micro_batch=true: FSDP reduces the gradients after every "
            "micro-batch instead of holding them unsharded through the accumulation, without "
            "which this layout does not fit"
        )
    if not chosen.fits:
        lines.append(f"note: {chosen.reason}")
    if config is not None:
        lines.append(_margin(config, chosen))
    lines.append(f"overrides: {overrides(plan, chosen)}")
    return lines


def _why(plan: Plan, chosen: Candidate) -> str:
    """Why this one: the cheapest, or a less painful rung within ``TIE`` of it."""
    if chosen.rung == CONFIG:
        return "the config's own [parallel] (--layout-from-config)"
    cheapest = plan.fitting[0]
    assert cheapest.cost is not None and chosen.cost is not None
    if cheapest is chosen or cheapest.cost.total >= chosen.cost.total:
        return "the cheapest estimate"
    return (
        f"within {TIE:.0%} of the cheapest ({cheapest.rung} {_describe(cheapest.layout)}, "
        f"{cheapest.cost.total:.3g} s) on a less painful rung"
    )


def _describe(layout: Layout | None) -> str:
    return layout.describe() if layout is not None else "-"


def _candidate(candidate: Candidate) -> dict[str, Any]:
    layout = candidate.layout
    return {
        "rung": candidate.rung,
        "layout": layout.by_name() if layout is not None else None,
        "activation_checkpointing": layout.activation_checkpointing if layout else None,
        "fp8": layout.fp8 if layout else None,
        "compile": layout.compile if layout else None,
        "pp_schedule": _schedule(layout) if layout else None,
        "pp_layers_per_stage": _layers(layout) if layout else None,
        "memory_gib_per_device": (
            _gib(candidate.breakdown.total) if candidate.breakdown is not None else None
        ),
        "cost_s": _seconds(candidate) if candidate.cost is not None else None,
        "fits": candidate.fits,
        "reason": candidate.reason,
    }


def _seconds(candidate: Candidate) -> dict[str, float]:
    assert candidate.cost is not None
    return {name: round(value, 4) for name, value in candidate.cost.seconds().items()}


def _layers(layout: Layout) -> list[int] | None:
    return list(layout.pp_layers_per_stage) if layout.pp_layers_per_stage is not None else None


def _gib(value: float) -> float:
    return round(value / GIB, 4)


def _schedule(layout: Layout) -> str | None:
    """A pipeline's schedule (None without one)."""
    return layout.pp_schedule if layout.pp > 1 else None
