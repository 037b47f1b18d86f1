"""``goodput ckpt``: list a run's checkpoints, convert them to and from HuggingFace Llama folders
and .pt files, import Megatron's and DeepSpeed's; each handler is one call into
``goodput.checkpoint`` or ``goodput.train.convert``, offline, in one process."""

from __future__ import annotations

import argparse
from pathlib import Path

from goodput.commands import Subparsers, add_command
from goodput.errors import ExitCode, GoodputError, warn_deprecated

# The kinds of `goodput ckpt import --from` besides hf, which megatron_files.source reads:
# named here so that `goodput --help` imports no torch.
IMPORT_KINDS = ("megatron", "megatron-legacy", "deepspeed")


def register(groups: Subparsers) -> None:
    ckpt = groups.add_parser(
        "ckpt",
        help="list checkpoints; convert them to and from HuggingFace Llama and .pt files; "
        "import Megatron and DeepSpeed checkpoints",
        description="Checkpoints of a run: list them, export a step to a HuggingFace Llama "
        "folder or a single .pt state dict, and import either, or a Megatron or DeepSpeed "
        "checkpoint, as a model-only checkpoint that "
        "`goodput train --resume` starts from. Runs offline, in one process.",
    )
    commands = ckpt.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub = add_command(
        commands,
        "list",
        _list,
        "every step-N checkpoint of a run: complete or not, size on disk, age, and which one "
        "'latest' names",
    )
    sub.add_argument("run_dir", type=Path, help="the run directory holding checkpoints/")
    sub.add_argument("--json", action="store_true", help="machine-readable output")

    sub = add_command(
        commands,
        "export-hf",
        _export_hf,
        "write a complete checkpoint as a HuggingFace LlamaForCausalLM folder "
        "(config.json + model.safetensors, fp32) with the tokenizer the run pinned, for "
        "transformers.AutoTokenizer; dense models only",
    )
    sub.add_argument("step_dir", type=Path, help="a checkpoint directory, RUN/checkpoints/step-N")
    sub.add_argument("out_dir", type=Path, help="the folder to create (must not hold anything)")
    sub.add_argument(
        "--tokenizer",
        type=Path,
        help="the tokenizer file to include (.model or tokenizer.json) instead of the one the "
        "run's blend pins; needed for model-only checkpoints",
    )

    sub = add_command(
        commands,
        "import",
        _import,
        "turn another framework's checkpoint into a model-only checkpoint "
        "OUTPUT/checkpoints/step-00000000: a HuggingFace Llama folder, Megatron-core "
        "torch_dist, Megatron-LM / Megatron-DeepSpeed legacy, or DeepSpeed ZeRO 0-2",
    )
    sub.add_argument("source", type=Path, help="the checkpoint folder (or its step's folder)")
    sub.add_argument(
        "--from",
        dest="kind",
        required=True,
        choices=("hf", *IMPORT_KINDS),
        help="the source's format",
    )
    sub.add_argument(
        "--config",
        type=Path,
        help="a TOML file whose [model] table the source must match (Megatron and DeepSpeed "
        "sources; an HF folder's config.json gives it)",
    )
    sub.add_argument(
        "--output", type=Path, required=True, help="the run directory to write the checkpoint into"
    )

    sub = add_command(
        commands,
        "import-hf",
        _import_hf,
        "deprecated spelling of `goodput ckpt import HF_DIR --from hf --output OUT_DIR`",
    )
    sub.add_argument("hf_dir", type=Path, help="the HuggingFace model folder")
    sub.add_argument("out_dir", type=Path, help="the run directory to write the checkpoint into")

    sub = add_command(
        commands,
        "to-torch",
        _to_torch,
        "write the consolidated model state dict of a complete checkpoint as one torch.save "
        "file of plain tensors (torch.load(..., weights_only=True) reads it)",
    )
    sub.add_argument("step_dir", type=Path, help="a checkpoint directory, RUN/checkpoints/step-N")
    sub.add_argument("file", type=Path, help="the .pt file to create")

    sub = add_command(
        commands,
        "from-torch",
        _from_torch,
        "turn a .pt state dict (read with weights_only=True) and a config's [model] table into "
        "a model-only checkpoint OUT_DIR/checkpoints/step-00000000",
    )
    sub.add_argument("file", type=Path, help="a .pt file holding the model's state dict")
    sub.add_argument("config", type=Path, help="a TOML file whose [model] table fits the weights")
    sub.add_argument("out_dir", type=Path, help="the run directory to write the checkpoint into")


def _list(args: argparse.Namespace) -> ExitCode:
    from goodput.checkpoint.listing import describe_checkpoints, format_checkpoints
    from goodput.io import print_json

    info = describe_checkpoints(args.run_dir)
    if args.json:
        print_json(info, where="goodput ckpt list --json", indent=2)
    else:
        print(format_checkpoints(info))
    return ExitCode.OK


def _export_hf(args: argparse.Namespace) -> ExitCode:
    from goodput.train.convert.checkpoints import export_hf

    out_dir = export_hf(args.step_dir, args.out_dir, args.tokenizer)
    print(f"{out_dir}: HuggingFace Llama folder written")
    return ExitCode.OK


def _import(args: argparse.Namespace) -> ExitCode:
    from goodput.train.convert.checkpoints import import_hf, import_megatron

    if args.kind == "hf":
        if args.config is not None:
            raise GoodputError.usage(
                "--config", "an HF folder's config.json gives the model", "leave --config out"
            )
        directory = import_hf(args.source, args.output)
    elif args.config is None:
        raise GoodputError.usage(
            "--config",
            f"--from {args.kind} needs the [model] config the checkpoint was trained with",
            "pass --config MODEL.toml",
        )
    else:
        directory = import_megatron(args.source, args.kind, args.config, args.output)
    print(f"{directory}: complete (model only); start from it with --resume {directory}")
    return ExitCode.OK


def _import_hf(args: argparse.Namespace) -> ExitCode:
    warn_deprecated(
        "goodput ckpt import-hf HF_DIR OUT_DIR",
        "goodput ckpt import HF_DIR --from hf --output OUT_DIR",
    )
    return _import(
        argparse.Namespace(kind="hf", source=args.hf_dir, output=args.out_dir, config=None)
    )


def _to_torch(args: argparse.Namespace) -> ExitCode:
    from goodput.train.convert.checkpoints import to_torch

    print(f"{to_torch(args.step_dir, args.file)}: model state dict written")
    return ExitCode.OK


def _from_torch(args: argparse.Namespace) -> ExitCode:
    from goodput.train.convert.checkpoints import from_torch

    directory = from_torch(args.file, args.config, args.out_dir)
    print(f"{directory}: complete (model only); start from it with --resume {directory}")
    return ExitCode.OK
