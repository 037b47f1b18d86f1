"""``goodput plan``: plan a run before it starts. ``layout``: the parallel layout a model needs
on a machine, climbing DP -> FSDP -> TP -> PP -> CP until one fits (``goodput.plan``); it
allocates nothing. ``reliability``: the failure budget of a job (``goodput.plan.reliability``).

The config is a run TOML: ``[model]`` is required; of ``[train]`` and ``[parallel]`` the planner
reads what is there (seq_len, micro_batch_size, tokens_per_step; precision,
activation_checkpointing, sync_every_micro_batch, tp), every key checked as the trainer checks
it, and the options override it. Without them: seq_len = model.max_seq_len, micro-batch 1,
precision fp32-master, no activation checkpointing; the global batch has no default. Option
errors are one line and exit 2, like every other usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from goodput import argtypes
from goodput.commands import Subparsers
from goodput.errors import ExitCode, GoodputError

if TYPE_CHECKING:
    from goodput.plan.memory import Workload
    from goodput.train.model_config import ModelConfig

PRECISIONS = ("fp32-master", "pure-bf16", "fp32")
MAX_NODES = 2**17  # above the largest machines (Aurora: 10,624 nodes)
MAX_GPUS_PER_NODE = 2**10
MAX_SURVIVAL = 0.999999  # closer to 1 asks the spare pool for a certainty floats cannot tell


def register(groups: Subparsers) -> None:
    plan = groups.add_parser(
        "plan",
        help="plan a run: the parallel layout a model needs, and its failure budget",
        description="Plan a run before it starts. Allocates nothing.",
    )
    commands = plan.add_subparsers(dest="command", required=True, metavar="COMMAND")
    layout = commands.add_parser(
        "layout",
        help="the parallel layout that fits a model on a machine, in order of pain",
        description="Climb DP -> FSDP (EP for MoE) -> TP within a node -> PP across nodes -> "
        "CP until a layout's estimated memory per device fits; print each rung rejected, the "
        "chosen layout's memory and its overrides. See docs/plan.md.",
    )
    layout.add_argument("config", type=Path, help="a run TOML with a [model] table")
    layout.add_argument(
        "--nodes", type=argtypes.positive_int, required=True, help="hosts of the machine"
    )
    layout.add_argument(
        "--gpus-per-node", type=argtypes.positive_int, required=True, help="devices per host"
    )
    layout.add_argument(
        "--gpu-mem-gb",
        type=argtypes.positive_float,
        required=True,
        help="memory per device in GiB (a vendor's '80 GB' HBM is 80 GiB)",
    )
    layout.add_argument(
        "--gbs-tokens",
        type=argtypes.positive_int,
        help="the global batch in tokens (default: train.tokens_per_step)",
    )
    layout.add_argument(
        "--seq-len", type=argtypes.positive_int, help="default: train.seq_len, else max_seq_len"
    )
    layout.add_argument(
        "--micro-batch-size",
        type=argtypes.positive_int,
        help="samples per forward pass (default: train.micro_batch_size, else 1)",
    )
    layout.add_argument(
        "--precision", choices=PRECISIONS, help="default: parallel.precision, else fp32-master"
    )
    layout.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="default: parallel.activation_checkpointing, else off",
    )
    layout.add_argument("--json", action="store_true", help="print one JSON object")
    layout.set_defaults(handler=_layout)

    reliability = commands.add_parser(
        "reliability",
        help="the failure budget: failures a day, the optimal checkpoint interval, the goodput "
        "to expect and the spare nodes a walltime needs",
        description="Expected failures a day, the Young/Daly optimal checkpoint interval, the "
        "expected goodput at it and at the configured one, and the spare-node pool that keeps "
        "a job alive for its walltime with a stated probability. See docs/plan.md.",
    )
    reliability.add_argument(
        "--nodes", type=argtypes.positive_int, required=True, help="nodes in the job"
    )
    reliability.add_argument(
        "--node-mtbf-days",
        type=argtypes.positive_float,
        required=True,
        help="mean time between failures of one node, in days (365: one a node-year)",
    )
    reliability.add_argument(
        "--save-stall-s",
        type=argtypes.positive_float,
        required=True,
        help="seconds a checkpoint holds training (an async save's snapshot, not its flush)",
    )
    reliability.add_argument(
        "--restart-s",
        type=argtypes.non_negative_float,
        required=True,
        help="seconds from a failure to training again (detection, restart, load)",
    )
    reliability.add_argument(
        "--step-s", type=argtypes.positive_float, help="seconds a step takes (intervals in steps)"
    )
    reliability.add_argument(
        "--interval-steps",
        type=argtypes.positive_int,
        help="the configured checkpoint.interval_steps, to compare (needs --step-s)",
    )
    reliability.add_argument(
        "--walltime-h",
        type=argtypes.positive_float,
        default=24.0,
        help="the job's walltime in hours, for the spare pool (default 24)",
    )
    reliability.add_argument(
        "--survival",
        type=argtypes.positive_float,
        default=0.99,
        help="the probability that the spare pool lasts the walltime (default 0.99)",
    )
    reliability.add_argument("--json", action="store_true", help="print one JSON object")
    reliability.set_defaults(handler=_reliability)


def _layout(args: argparse.Namespace) -> ExitCode:
    from goodput.plan.ladder import Machine, plan_layout
    from goodput.plan.layout import Layout
    from goodput.plan.report import format_text, to_json

    model, train, parallel = _read_config(args.config)
    work = _workload(args, model, train, parallel)
    if args.nodes > MAX_NODES or args.gpus_per_node > MAX_GPUS_PER_NODE:
        raise GoodputError.usage(
            "--nodes/--gpus-per-node",
            f"{args.nodes} nodes x {args.gpus_per_node} devices is beyond any machine",
            f"give at most {MAX_NODES} nodes of at most {MAX_GPUS_PER_NODE} devices",
        )
    machine = Machine(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_mem_gib=args.gpu_mem_gb
    )
    given = Layout(tp=parallel["tp"]) if "tp" in parallel else None
    plan = plan_layout(model, machine, work, given)
    if plan.chosen is None:
        what, fix = plan.failure()
        raise GoodputError(args.config, what, fix)
    print(to_json(plan) if args.json else format_text(plan, str(args.config)))
    return ExitCode.OK


def _reliability(args: argparse.Namespace) -> ExitCode:
    from goodput.plan.reliability import DAY_S, Budget, format_text, plan_reliability

    if args.interval_steps is not None and args.step_s is None:
        raise GoodputError.usage(
            "--interval-steps", "needs --step-s to become seconds", "pass --step-s T as well"
        )
    if args.nodes > MAX_NODES:
        raise GoodputError.usage(
            "--nodes", f"{args.nodes} nodes is beyond any machine", f"give at most {MAX_NODES}"
        )
    if args.survival > MAX_SURVIVAL:
        raise GoodputError.usage(
            "--survival",
            f"{args.survival:g} is not a probability below 1 (at most {MAX_SURVIVAL})",
            "give e.g. 0.99",
        )
    budget = Budget(
        nodes=args.nodes,
        node_mtbf_s=args.node_mtbf_days * DAY_S,
        save_stall_s=args.save_stall_s,
        restart_s=args.restart_s,
        walltime_s=args.walltime_h * 3600,
        survival=args.survival,
        step_s=args.step_s,
        interval_steps=args.interval_steps,
    )
    report = plan_reliability(budget)
    if args.json:
        from goodput.io import print_json

        print_json(report.as_dict(), where="goodput plan reliability --json", indent=2)
    else:
        print(format_text(report))
    return ExitCode.OK


def _read_config(path: Path) -> tuple[ModelConfig, dict[str, Any], dict[str, Any]]:
    """The [model] config, and the [train] and [parallel] keys present, each checked as the
    trainer checks it."""
    from goodput.config import from_table, read_toml
    from goodput.train.config import TrainConfig
    from goodput.train.model_config import ModelConfig
    from goodput.train.parallel_config import ParallelConfig

    raw = read_toml(path)
    if not isinstance(raw.get("model"), dict):
        raise GoodputError.usage(path, "no [model] table", "add a [model] section")
    model = from_table(ModelConfig, raw["model"], str(path), "model.")
    return (
        model,
        _present(TrainConfig, raw, "train", path),
        _present(ParallelConfig, raw, "parallel", path),
    )


def _present(cls: type, raw: dict[str, Any], section: str, path: Path) -> dict[str, Any]:
    """The keys of ``[section]`` that are there, each coerced as ``cls``'s field (type and
    range); an unknown key is refused, a missing one is simply absent."""
    from goodput.config import coerce_field

    table = raw.get(section, {})
    if not isinstance(table, dict):
        raise GoodputError.usage(path, f"'{section}' is not a table", f"write it as [{section}]")
    names = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(table) - names)
    if unknown:
        raise GoodputError.usage(
            path,
            f"unknown key '{section}.{unknown[0]}'",
            f"valid keys in [{section}]: " + ", ".join(sorted(names)),
        )
    return {
        key: coerce_field(cls, key, value, str(path), f"{section}.{key}")
        for key, value in table.items()
    }


def _workload(
    args: argparse.Namespace,
    model: ModelConfig,
    train: dict[str, Any],
    parallel: dict[str, Any],
) -> Workload:
    from goodput.plan.memory import Workload

    seq_len = args.seq_len or train.get("seq_len") or model.max_seq_len
    if seq_len > model.max_seq_len:
        raise GoodputError.usage(
            "--seq-len" if args.seq_len else f"{args.config} [train]",
            f"seq_len {seq_len} exceeds model.max_seq_len {model.max_seq_len}",
            "lower the sequence length or raise model.max_seq_len",
        )
    gbs_tokens = args.gbs_tokens or train.get("tokens_per_step")
    if gbs_tokens is None:
        raise GoodputError.usage(
            "--gbs-tokens",
            f"no global batch: {args.config} has no train.tokens_per_step",
            "pass --gbs-tokens T, the global batch in tokens (e.g. 1048576)",
        )
    if gbs_tokens % seq_len:
        suggestion = max(1, round(gbs_tokens / seq_len)) * seq_len
        raise GoodputError.usage(
            "--gbs-tokens" if args.gbs_tokens else f"{args.config} [train]",
            f"the global batch of {gbs_tokens} tokens is not a multiple of seq_len {seq_len}",
            f"use a multiple of {seq_len}, e.g. {suggestion}",
        )
    checkpointing = args.activation_checkpointing
    if checkpointing is None:  # [train] activation_checkpointing is the deprecated spelling
        checkpointing = parallel.get(
            "activation_checkpointing", bool(train.get("activation_checkpointing"))
        )
    return Workload(
        seq_len=seq_len,
        micro_batch_size=args.micro_batch_size or train.get("micro_batch_size") or 1,
        global_batch_samples=gbs_tokens // seq_len,
        precision=args.precision or parallel.get("precision", "fp32-master"),
        activation_checkpointing=checkpointing,
        sync_every_micro_batch=parallel.get("sync_every_micro_batch", False),
    )
