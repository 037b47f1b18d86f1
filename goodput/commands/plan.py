"""``goodput plan``: plan a run before it starts. ``layout``: the parallel layout a model needs
on a machine, the cheapest step of those that fit (``goodput.plan``); it allocates nothing
unless ``--verify`` asks ``goodput.plan.verify`` to build it. ``reliability``: the failure budget
of a job (``goodput.plan.reliability``).

The config is a run TOML: ``[model]`` is required; of ``[train]`` and ``[parallel]`` the planner
reads what is there (seq_len, micro_batch_size, tokens_per_step; precision,
sync_every_micro_batch, tp; all of [parallel] with --layout-from-config), every key checked as
the trainer checks it, and the options override it. Without them: seq_len = DEFAULT_SEQ_LEN
(capped at model.max_seq_len), micro-batch 1, precision fp32-master; activation checkpointing
is the planner's to choose unless an option forces it; the global batch has no default. Option
errors are one line and exit 2, like every other usage error.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from goodput import argtypes
from goodput.commands import Subparsers
from goodput.errors import ExitCode, GoodputError

if TYPE_CHECKING:
    from goodput.plan.layout import Layout
    from goodput.plan.memory import Workload
    from goodput.train.config.model import ModelConfig
    from goodput.train.config.parallel import ParallelConfig

# train/config/precision.py's names, spelled here so that building the parser imports no part
# (goodput --help stays instant); a test holds the two equal.
PRECISIONS = ("fp32-master", "pure-bf16", "fp32")
MAX_NODES = 2**17  # above the largest machines (Aurora: 10,624 nodes)
MAX_GPUS_PER_NODE = 2**10
DEFAULT_SEQ_LEN = 8192  # Llama 3's pre-training length; capped at model.max_seq_len
DEFAULT_TFLOPS = 400.0  # ~40% MFU of an H100's 989 dense bf16 TFLOP/s
DEFAULT_INTRA_GBPS = 300.0  # NVLink-class: H100 NVLink 4 is 450 GB/s a direction
DEFAULT_INTER_GBPS = 25.0  # one 200 Gb/s NIC per device (Polaris, Perlmutter)
# The step cost's rates: from a CPU core's GFLOP/s and a MB/s link to an EFLOP/s device and a
# PB/s link. Within them every cost the model computes is a finite number of seconds (the
# largest model's step of 2^40 tokens at 1 GFLOP/s is ~1e21 s); a subnormal rate made it infinite.
MIN_RATE, MAX_RATE = 1e-3, 1e6
rate = argtypes.number(MIN_RATE, MAX_RATE, low_open=False)
# plan/layout.py's and plan/calibration.py's names, spelled here so that building the parser
# imports neither; a test holds them equal.
AC_MODES = ("none", "full", "op", "budget")
FP8_RECIPES = ("rowwise", "tensorwise")
DEVICE_NAMES = ("h100", "h100-500w", "h200", "mi250x", "max1550")
MAX_SURVIVAL = 0.999999  # closer to 1 asks the spare pool for a certainty floats cannot tell


def register(groups: Subparsers) -> None:
    plan = groups.add_parser(
        "plan",
        help="plan a run: the parallel layout a model needs, and its failure budget",
        description="Plan a run before it starts. Allocates nothing.",
    )
    commands = plan.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_layout(commands)
    _add_reliability(commands)


def _add_layout(commands: Subparsers) -> None:
    layout = commands.add_parser(
        "layout",
        help="the parallel layout that fits a model on a machine at the least cost per step",
        description="Try every layout goodput's trainer could run, in order of pain (DP -> "
        "FSDP (EP for MoE) -> activation checkpointing -> TP within a host -> PP across hosts "
        "-> CP); of those whose estimated memory per device fits and that split the global "
        "batch, choose the cheapest step by an estimate of its communication, recompute and "
        "pipeline bubble (costs within 1% are a tie: the least painful wins). Print the "
        "cheapest candidates, the closest rejection of each rung, the chosen layout's memory "
        "and its overrides. See docs/plan.md.",
    )
    layout.add_argument("config", type=Path, help="a run TOML with a [model] table")
    argtypes.add_renamed(
        layout,
        "--nhosts",
        "--nodes",  # the old spelling, deprecated
        type=argtypes.positive_int,
        required=True,
        help=f"hosts of the machine (at most {MAX_NODES})",
    )
    argtypes.add_renamed(
        layout,
        "--ppn",
        "--gpus-per-node",  # the old spelling, deprecated
        type=argtypes.positive_int,
        required=True,
        help=f"devices (ranks) per host (at most {MAX_GPUS_PER_NODE})",
    )
    layout.add_argument(
        "--gpu-mem-gb",
        type=argtypes.positive_float,
        help="memory per device in GiB (a vendor's '80 GB' HBM is 80 GiB; default: the "
        "--device's; one of the two is required)",
    )
    _add_workload_options(layout)
    _add_rate_options(layout)
    _add_report_options(layout)
    layout.set_defaults(handler=_layout)


def _add_workload_options(layout: argparse.ArgumentParser) -> None:
    """What one step asks (``plan.memory.Workload``): the batch, the sequence, the precision."""
    layout.add_argument(
        "--gbs-tokens",
        type=argtypes.positive_int,
        help="the global batch in tokens (default: train.tokens_per_step)",
    )
    layout.add_argument(
        "--seq-len",
        type=argtypes.positive_int,
        help=f"default: train.seq_len, else {DEFAULT_SEQ_LEN} (or model.max_seq_len if shorter)",
    )
    layout.add_argument(
        "--micro-batch-size",
        type=argtypes.positive_int,
        help="samples per forward pass (default: train.micro_batch_size, else 1)",
    )
    layout.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="default: parallel.precision, else fp32-master",
    )
    layout.add_argument(
        "--activation-checkpointing",
        choices=(*AC_MODES, "any"),
        nargs="?",
        const="full",  # the old bare flag: whole blocks
        help="the checkpointing modes the planner may choose: one, or any (default: none, "
        "full and op; budget too with --compile); bare: full",
    )
    layout.add_argument(
        "--no-activation-checkpointing",
        dest="activation_checkpointing",
        action="store_const",
        const="none",
        help="the same as --activation-checkpointing none",
    )
    layout.add_argument(
        "--fp8",
        choices=(*FP8_RECIPES, "any", "none"),
        help="the fp8 scalings the planner may choose beside bf16 (default: the config's "
        "parallel.fp8, else none); never on a device without FP8 matmuls",
    )
    layout.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="let the planner compile the blocks where the trainer can (default: the config's "
        "parallel.compile)",
    )


def _add_rate_options(layout: argparse.ArgumentParser) -> None:
    """What a device computes and moves a second (``plan.cost.Rates``), for the step cost."""
    layout.add_argument(
        "--device",
        choices=DEVICE_NAMES,
        help="the calibrated constants of a device (plan.calibration: its compute rate, "
        "bandwidths, fp8 and compile speed-ups and memory, fitted on published runs; see "
        "docs/plan.md); --tflops/--intra-gbps/--inter-gbps/--gpu-mem-gb override them",
    )
    layout.add_argument(
        "--tflops",
        type=rate,
        help="TFLOP/s one device achieves in the compute dtype, for the step cost (default: "
        f"the --device's, else {DEFAULT_TFLOPS:g}: ~40%% of an H100's dense bf16 peak; "
        f"{MIN_RATE:g} to {MAX_RATE:g})",
    )
    layout.add_argument(
        "--intra-gbps",
        type=rate,
        help="GB/s per device to the devices of its host, for the step cost (default: the "
        f"--device's, else {DEFAULT_INTRA_GBPS:g}: NVLink-class; {MIN_RATE:g} to {MAX_RATE:g})",
    )
    layout.add_argument(
        "--inter-gbps",
        type=rate,
        help="GB/s per device to other hosts, for the step cost (default: the --device's, "
        f"else {DEFAULT_INTER_GBPS:g}: one 200 Gb/s NIC per device; {MIN_RATE:g} to "
        f"{MAX_RATE:g})",
    )


def _add_report_options(layout: argparse.ArgumentParser) -> None:
    """Which layout is reported (the planner's or the config's), checked how, printed how."""
    layout.add_argument(
        "--layout-from-config",
        action="store_true",
        help="report the config's own [parallel] layout (memory and cost) instead of the "
        "planner's choice",
    )
    layout.add_argument(
        "--verify",
        action="store_true",
        help="build the layout under a fake process group of the whole world on this CPU and "
        "compare its state per device with the estimate; materialise one rank",
    )
    layout.add_argument(
        "--rank",
        type=argtypes.non_negative_int,
        help="with --verify: the rank to materialise (default: the one with the most state)",
    )
    layout.add_argument("--json", action="store_true", help="print one JSON object")


def _add_reliability(commands: Subparsers) -> None:
    reliability = commands.add_parser(
        "reliability",
        help="the failure budget: failures a day, the optimal checkpoint interval, the goodput "
        "to expect and the spare nodes a walltime needs",
        description="Expected failures a day, the Young/Daly optimal checkpoint interval, the "
        "expected goodput at it and at the configured one, and the spare-node pool that keeps "
        "a job alive for its walltime with a stated probability. See docs/plan.md.",
    )
    argtypes.add_renamed(
        reliability,
        "--nhosts",
        "--nodes",  # the old spelling, deprecated
        type=argtypes.positive_int,
        required=True,
        help="hosts (nodes) in the job",
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
    _add_interval_options(reliability)
    reliability.add_argument("--json", action="store_true", help="print one JSON object")
    reliability.set_defaults(handler=_reliability)


def _add_interval_options(reliability: argparse.ArgumentParser) -> None:
    """The intervals to compare and the walltime the spare pool must last."""
    reliability.add_argument(
        "--step-s", type=argtypes.positive_float, help="seconds a step takes (intervals in steps)"
    )
    reliability.add_argument(
        "--interval-steps",
        type=argtypes.positive_int,
        help="the configured checkpoint.interval_steps, to compare (needs --step-s)",
    )
    reliability.add_argument(
        "--memory-interval-steps",
        type=argtypes.positive_int,
        help="checkpoint.memory_interval_steps: in-memory checkpoints every K steps, their lost "
        "work and goodput against disk checkpoints alone (needs --step-s)",
    )
    reliability.add_argument(
        "--memory-stall-s",
        type=argtypes.positive_float,
        help="seconds an in-memory checkpoint holds training (default: --save-stall-s)",
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


def _layout(args: argparse.Namespace) -> ExitCode:
    from goodput.plan.calibration import DEVICES
    from goodput.plan.ladder import Machine, plan_layout
    from goodput.plan.report import format_text, to_json

    model, train, parallel = _read_config(args.config)
    work, seq_from = _workload(args, model, train, parallel)
    if args.nhosts > MAX_NODES or args.ppn > MAX_GPUS_PER_NODE:
        raise GoodputError.usage(
            "--nhosts/--ppn",
            f"{args.nhosts} hosts x {args.ppn} devices is beyond any machine",
            f"give at most {MAX_NODES} hosts of at most {MAX_GPUS_PER_NODE} devices",
        )
    if args.rank is not None and not args.verify:
        raise GoodputError.usage("--rank", "only --verify materialises a rank", "add --verify")
    device = DEVICES[args.device] if args.device else None
    if args.gpu_mem_gb is None and device is None:
        raise GoodputError.usage(
            "--gpu-mem-gb", "no memory per device", "pass --gpu-mem-gb GIB, or --device NAME"
        )
    machine = Machine(
        nhosts=args.nhosts,
        ppn=args.ppn,
        gpu_mem_gib=args.gpu_mem_gb or (device.memory_gib if device else 0.0),
    )
    rates = _rates(args, device)
    given = _given_layout(args, model, parallel, machine.world)
    options = _options(args, parallel, rates)
    plan = plan_layout(model, machine, work, rates, options=options, given=given)
    chosen = plan.chosen
    if args.layout_from_config:
        assert given is not None
        if given.fp8 is not None and rates.fp8(given.fp8) is None:
            raise GoodputError.usage(
                f"{args.config} [parallel]",
                f"fp8 = '{given.fp8}', but {args.device} has no FP8 matmuls (--layout-from-config)",
                "unset parallel.fp8 for this device",
            )
        chosen = _config_candidate(plan, model, given)
    if chosen is None:
        what, fix = plan.failure()
        if args.json:
            print(to_json(plan, seq_from, error=f"{what}; {fix}"))
        raise GoodputError(args.config, what, fix)
    extra: dict[str, Any] = {}
    verified = None
    if args.verify:
        verified = _verify(args, model, parallel, work, chosen)
        extra["verified"] = verified.to_json()
    if args.json:
        print(to_json(plan, seq_from, chosen, extra=extra))
    else:
        config = None if args.layout_from_config else _config_layout(model, parallel, plan)
        print(format_text(plan, str(args.config), seq_from, chosen, config))
        if verified is not None:
            print(verified.format_text())
    return ExitCode.OK


def _rates(args: argparse.Namespace, device: Any) -> Any:
    """The step cost's rates: the --device's (``plan.calibration.DEVICES``), each overridden
    by its flag; without --device the flags' defaults, with the H100's fitted fp8 and compile
    speed-ups (the only ones measured)."""
    from goodput.plan.calibration import DEVICES
    from goodput.plan.cost import Rates

    base = device or DEVICES["h100"]
    return Rates(
        flops=(args.tflops or (device.tflops if device else DEFAULT_TFLOPS)) * 1e12,
        intra_bytes=(args.intra_gbps or (device.intra_gbps if device else DEFAULT_INTRA_GBPS))
        * 1e9,
        inter_bytes=(args.inter_gbps or (device.inter_gbps if device else DEFAULT_INTER_GBPS))
        * 1e9,
        ppn=args.ppn,
        fp8_rowwise=base.fp8_rowwise,
        fp8_tensorwise=base.fp8_tensorwise,
        compile=base.compile,
        gemm_half_dim=device.gemm_half_dim if device else 0.0,
    )


def _options(args: argparse.Namespace, parallel: dict[str, Any], rates: Any) -> Any:
    """What the ladder may choose of checkpointing, fp8 and compile: the flags, else what the
    config's [parallel] allows (its fp8 recipe, its compile)."""
    from goodput.plan.ladder import Options

    compiled = args.compile if args.compile is not None else parallel.get("compile", False)
    mode = args.activation_checkpointing or "any"
    # "any": every mode, a memory budget only under compile (the trainer's rule).
    modes = tuple(m for m in AC_MODES if m != "budget" or compiled) if mode == "any" else (mode,)
    if mode == "budget" and not compiled:
        raise GoodputError.usage(
            "--activation-checkpointing budget",
            "a memory budget is torch.compile's",
            "add --compile, or choose another mode",
        )
    recipe = args.fp8 or parallel.get("fp8") or "none"
    fp8: tuple[str | None, ...] = (None,)
    if recipe != "none":
        fp8 = (None, *(FP8_RECIPES if recipe == "any" else (recipe,)))
        if args.fp8 and all(rates.fp8(r) is None for r in fp8 if r):
            raise GoodputError.usage(
                "--fp8", f"{args.device} has no FP8 matmuls", "drop --fp8 for this device"
            )
    return Options(
        checkpointing=modes,
        memory_budget=parallel.get("activation_memory_budget", 0.5),
        fp8=fp8,
        compile=(False, True) if compiled else (False,),
    )


def _given_layout(
    args: argparse.Namespace, model: ModelConfig, parallel: dict[str, Any], world: int
) -> Layout | None:
    """The config's own [parallel] as a layout: all of it with --layout-from-config (its unset
    data-parallel degree resolved as the trainer resolves it), else its tp only (for the
    warning when it spans hosts)."""
    from goodput.plan.layout import Layout

    if not args.layout_from_config:
        return Layout(tp=parallel["tp"]) if "tp" in parallel else None
    cfg = _parallel_config(parallel, args.config)
    try:
        return _layout_of(cfg, world)
    except GoodputError as error:
        raise GoodputError.usage(
            f"{args.config} [parallel]", f"{error.what} (--layout-from-config)", error.fix
        ) from None


def _config_layout(model: ModelConfig, parallel: dict[str, Any], plan: Any) -> Any:
    """The config's own [parallel] evaluated beside the planner's choice (for the margin the
    text prints), when it names a layout the trainer takes on this machine; else None."""
    from goodput.plan.ladder import evaluate
    from goodput.plan.report import CONFIG

    if not parallel:
        return None
    try:
        layout = _layout_of(_parallel_config(parallel, "[parallel]"), plan.machine.world)
    except GoodputError:
        return None
    if layout.fp8 is not None and plan.rates.fp8(layout.fp8) is None:
        return None
    candidate = evaluate(model, plan.machine, plan.work, plan.rates, layout, CONFIG)
    return candidate if candidate.cost is not None else None


def _layout_of(cfg: ParallelConfig, world: int) -> Layout:
    """A [parallel] config as the planner's layout (its unset data-parallel degree resolved
    as the trainer resolves it)."""
    from goodput.plan.layout import Layout
    from goodput.train.config.parallel import resolve_degrees

    return Layout(
        **resolve_degrees(cfg, world).by_name(),
        activation_checkpointing=cfg.activation_checkpointing,
        activation_memory_budget=cfg.activation_memory_budget,
        fp8=cfg.fp8,
        compile=cfg.compile,
        pp_schedule=cfg.pp_schedule,
        pp_stages_per_rank=cfg.pp_stages_per_rank,
        pp_layers_per_stage=cfg.pp_layers_per_stage,
    )


def _config_candidate(plan: Any, model: ModelConfig, given: Layout) -> Any:
    """The config's layout evaluated as the planner evaluates its own; a layout the trainer
    refuses is a usage error naming the config."""
    from goodput.plan.ladder import evaluate
    from goodput.plan.report import CONFIG

    candidate = evaluate(model, plan.machine, plan.work, plan.rates, given, CONFIG)
    if candidate.breakdown is None:
        raise GoodputError.usage(
            "[parallel]", f"{candidate.reason} (--layout-from-config)", "fix the config's layout"
        )
    return candidate


def _verify(
    args: argparse.Namespace,
    model: ModelConfig,
    parallel: dict[str, Any],
    work: Workload,
    chosen: Any,
) -> Any:
    """``plan.verify`` on the reported layout: the config's own [parallel] with
    --layout-from-config, else the planner's choice with the settings it assumed."""
    from goodput.plan.memory import GIB, state_bytes_per_device
    from goodput.plan.verify import verify_layout

    layout = chosen.layout
    if args.layout_from_config:
        cfg = _parallel_config(parallel, args.config)
    else:
        table: dict[str, Any] = {
            **layout.by_name(),
            "activation_checkpointing": layout.activation_checkpointing,
            "compile": layout.compile,
            "precision": work.precision,
            "sync_every_micro_batch": chosen.sync_every_micro_batch or work.sync_every_micro_batch,
        }
        if layout.pp > 1:
            table["pp_schedule"] = layout.pp_schedule
        if layout.pp > 1 and layout.pp_stages_per_rank is not None:
            table["pp_stages_per_rank"] = layout.pp_stages_per_rank
        if layout.pp_layers_per_stage is not None:
            table["pp_layers_per_stage"] = layout.pp_layers_per_stage
        if layout.fp8 is not None:
            table["fp8"] = layout.fp8
        if layout.activation_checkpointing == "budget":
            table["activation_memory_budget"] = layout.activation_memory_budget
        cfg = _parallel_config(table, "the planner's layout")
    return verify_layout(
        args.config,
        model,
        cfg,
        nhosts=args.nhosts,
        ppn=args.ppn,
        seq_len=work.seq_len,
        micro_batch_size=work.micro_batch_size,
        global_batch_size=work.global_batch_samples,
        rank=args.rank,
        estimated_state_gib=state_bytes_per_device(model, layout, work.precision) / GIB,
    )


def _parallel_config(parallel: dict[str, Any], where: Path | str) -> ParallelConfig:
    """A whole [parallel] table (the config's, or the planner's layout) as the trainer reads
    it."""
    from goodput.config import from_table
    from goodput.train.config.parallel import ParallelConfig

    # read_present coerced the lists to tuples (pp_layers_per_stage); the table takes TOML's
    # lists.
    table = {key: list(v) if isinstance(v, tuple) else v for key, v in parallel.items()}
    return from_table(ParallelConfig, table, str(where), "parallel.")


def _reliability(args: argparse.Namespace) -> ExitCode:
    from goodput.plan.reliability import DAY_S, Budget, format_text, plan_reliability

    for option, value in (("--interval-steps", args.interval_steps),
                          ("--memory-interval-steps", args.memory_interval_steps)):  # fmt: skip
        if value is not None and args.step_s is None:
            raise GoodputError.usage(
                option, "needs --step-s to become seconds", "pass --step-s T as well"
            )
    if args.memory_stall_s is not None and args.memory_interval_steps is None:
        raise GoodputError.usage(
            "--memory-stall-s",
            "is a memory snapshot's stall: there are none without --memory-interval-steps",
            "pass --memory-interval-steps K as well",
        )
    if args.nhosts > MAX_NODES:
        raise GoodputError.usage(
            "--nhosts", f"{args.nhosts} hosts is beyond any machine", f"give at most {MAX_NODES}"
        )
    if args.survival > MAX_SURVIVAL:
        raise GoodputError.usage(
            "--survival",
            f"{args.survival:g} is not a probability below 1 (at most {MAX_SURVIVAL})",
            "give e.g. 0.99",
        )
    budget = Budget(
        nodes=args.nhosts,
        node_mtbf_s=args.node_mtbf_days * DAY_S,
        save_stall_s=args.save_stall_s,
        restart_s=args.restart_s,
        walltime_s=args.walltime_h * 3600,
        survival=args.survival,
        step_s=args.step_s,
        interval_steps=args.interval_steps,
        memory_interval_steps=args.memory_interval_steps,
        memory_stall_s=args.memory_stall_s,
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
    trainer checks it (``config.read_present``)."""
    from goodput.config import from_table, read_present, read_toml
    from goodput.train.config.model import ModelConfig
    from goodput.train.config.parallel import ParallelConfig
    from goodput.train.config.run import TrainConfig

    raw = read_toml(path)
    if not isinstance(raw.get("model"), dict):
        raise GoodputError.usage(path, "no [model] table", "add a [model] section")
    model = from_table(ModelConfig, raw["model"], str(path), "model.")
    present: dict[str, dict[str, Any]] = {}
    for section, cls in (("train", TrainConfig), ("parallel", ParallelConfig)):
        table = raw.get(section, {})
        if not isinstance(table, dict):
            raise GoodputError.usage(
                path, f"'{section}' is not a table", f"write it as [{section}]"
            )
        present[section] = read_present(cls, table, str(path), f"{section}.")
    return model, present["train"], present["parallel"]


def _workload(
    args: argparse.Namespace,
    model: ModelConfig,
    train: dict[str, Any],
    parallel: dict[str, Any],
) -> tuple[Workload, str]:
    """The step's workload, and where its seq_len came from."""
    from goodput.plan.memory import Workload

    if args.seq_len:
        seq_len, seq_from = args.seq_len, "--seq-len"
    elif "seq_len" in train:
        seq_len, seq_from = train["seq_len"], "train.seq_len"
    else:
        seq_len = min(DEFAULT_SEQ_LEN, model.max_seq_len)
        seq_from = f"the default {DEFAULT_SEQ_LEN}, no train.seq_len"
        if seq_len < DEFAULT_SEQ_LEN:
            seq_from = f"model.max_seq_len, below the default {DEFAULT_SEQ_LEN}"
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
    work = Workload(
        seq_len=seq_len,
        micro_batch_size=args.micro_batch_size or train.get("micro_batch_size") or 1,
        global_batch_samples=gbs_tokens // seq_len,
        precision=args.precision or parallel.get("precision", "fp32-master"),
        sync_every_micro_batch=parallel.get("sync_every_micro_batch", False),
    )
    return work, seq_from
