"""``goodput data``: the data pipeline, demo-corpus -> train-tokenizer -> tokenize -> blend ->
verify, and inspect; each handler is one call into ``goodput.data``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from goodput import argtypes
from goodput.commands import Subparsers, add_command
from goodput.errors import ExitCode

if TYPE_CHECKING:
    from goodput.data.stages import BlendStage


def register(groups: Subparsers) -> None:
    data = groups.add_parser(
        "data",
        help="tokenize once, blend by weight, pin everything",
        description="The data pipeline: demo-corpus -> train-tokenizer -> "
        "tokenize -> blend -> verify.",
    )
    commands = data.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo_corpus(commands)
    _add_train_tokenizer(commands)
    _add_tokenize(commands)
    _add_inspect(commands)
    _add_blend(commands)
    _add_verify(commands)


def _add_demo_corpus(commands: Subparsers) -> None:
    sub = add_command(
        commands,
        "demo-corpus",
        _demo_corpus,
        "write the embedded multi-domain corpus (code, docs, "
        "docstrings from this Python's standard library) as JSONL, one folder per domain",
    )
    sub.add_argument("--output", type=Path, required=True, help="directory to write into")


def _add_train_tokenizer(commands: Subparsers) -> None:
    sub = add_command(
        commands,
        "train-tokenizer",
        _train_tokenizer,
        "train a SentencePiece model on raw inputs (deterministic settings)",
    )
    sub.add_argument("inputs", nargs="+", type=Path, help="files or folders of documents")
    sub.add_argument("--vocab-size", type=argtypes.positive_int, required=True)
    sub.add_argument("--output", type=Path, required=True, help="the .model file to write")
    sub.add_argument("--text-field", default="text", help="JSON field holding the text")


def _add_tokenize(commands: Subparsers) -> None:
    sub = add_command(
        commands,
        "tokenize",
        _tokenize,
        "tokenize documents once into Megatron .bin/.idx shards "
        "plus NAME.manifest.json (written last); resumable, parallel",
    )
    sub.add_argument(
        "inputs",
        nargs="+",
        type=Path,
        help="files or folders of .jsonl, .jsonl.gz, .jsonl.zst, .parquet, .txt",
    )
    sub.add_argument(
        "--tokenizer",
        type=Path,
        required=True,
        help="a SentencePiece .model or a HF tokenizer.json",
    )
    sub.add_argument(
        "--tokenizer-kind",
        choices=["sentencepiece", "hf"],
        help="override the kind guessed from the file name",
    )
    sub.add_argument("--output", type=Path, required=True)
    sub.add_argument("--name", help="dataset name (default: the first input's stem)")
    sub.add_argument(
        "--workers",
        type=argtypes.positive_int,
        default=os.cpu_count() or 1,
        help="worker processes, each writing its own shards (default: all cores)",
    )
    sub.add_argument(
        "--shard-size-mb",
        type=argtypes.positive_float,
        default=1024.0,
        help="input MB per shard, whole files (default 1024)",
    )
    sub.add_argument("--text-field", default="text")
    sub.add_argument(
        "--pack-seq-len",
        type=argtypes.positive_int,
        help="write rows of L+1 tokens packed across documents",
    )


def _add_inspect(commands: Subparsers) -> None:
    sub = add_command(
        commands,
        "inspect",
        _inspect,
        "show a shard or dataset: documents, tokens, dtype, the "
        "first document, and verify checksums against the manifest",
    )
    sub.add_argument("path", type=Path, help="a shard prefix/.bin/.idx or a NAME.manifest.json")
    sub.add_argument("--tokenizer", type=Path, help="decode the first document with it")
    sub.add_argument("--json", action="store_true", help="machine-readable output")


def _add_blend(commands: Subparsers) -> None:
    sub = add_command(
        commands,
        "blend",
        _blend,
        "build the weighted, deterministic blend index from a file list "
        "of 'weight path-prefix corpus' lines and print the mixture report",
    )
    sub.add_argument(
        "file_list", type=Path, help="stage 0's file list (the whole blend's without --stage)"
    )
    sub.add_argument(
        "--stage",
        type=_stage,
        action="append",
        default=[],
        metavar="START_SAMPLE:FILE_LIST",
        help="a data-mix stage from global sample START_SAMPLE on, mixed as FILE_LIST says; "
        "repeat for stages 1, 2, ... in order of their starts",
    )
    sub.add_argument(
        "--step-samples",
        type=argtypes.positive_int,
        default=1,
        metavar="N",
        help="samples per training step (the global batch): every stage starts on a step "
        "(default 1)",
    )
    sub.add_argument("--seq-len", type=argtypes.positive_int, required=True)
    sub.add_argument(
        "--num-samples",
        type=argtypes.positive_int,
        required=True,
        help="global samples of seq_len+1 tokens (steps x global batch)",
    )
    sub.add_argument("--seed", type=argtypes.non_negative_int, required=True)
    _add_blend_output_options(sub)


def _add_blend_output_options(sub: argparse.ArgumentParser) -> None:
    """Where the blend goes, what it does when a corpus runs out, and what it reports."""
    argtypes.add_renamed(
        sub,
        "--cache",
        "--output",  # the old spelling, deprecated
        type=Path,
        required=True,
        help="the blend cache ([data] cache); the blend lands in CACHE/blends/<fingerprint>",
    )
    sub.add_argument(
        "--on-exhausted",
        choices=["repeat", "error"],
        default="repeat",
        help="a corpus asked for more samples than it holds: repeat it in fresh "
        "shuffles (with a warning) or refuse (default: repeat)",
    )
    sub.add_argument(
        "--report-batch-size",
        type=argtypes.positive_int,
        default=256,
        help="batch size for the per-batch mixture deviation in the report",
    )
    sub.add_argument(
        "--holdout-samples",
        type=argtypes.non_negative_int,
        default=0,
        metavar="N",
        help="hold N samples of every corpus out of training, for evaluation (as [eval] "
        "holdout_samples; default 0)",
    )
    sub.add_argument("--json", action="store_true", help="print the run manifest as JSON")


def _add_verify(commands: Subparsers) -> None:
    sub = add_command(
        commands,
        "verify",
        _verify,
        "re-check pinned data: a blend directory (its fingerprint, "
        "every shard's checksum, the tokenizer) or a dataset manifest",
    )
    sub.add_argument("path", type=Path, help="a blend directory, blend.json or *.manifest.json")


def _demo_corpus(args: argparse.Namespace) -> ExitCode:
    from goodput.data.demo_corpus import build_demo_corpus

    for domain, path in build_demo_corpus(args.output).items():
        print(f"{domain}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return ExitCode.OK


def _train_tokenizer(args: argparse.Namespace) -> ExitCode:
    from goodput.data.readers import list_inputs
    from goodput.data.tokenizer import train_sentencepiece

    path = train_sentencepiece(
        list_inputs(args.inputs), args.vocab_size, args.output, text_field=args.text_field
    )
    print(path)
    return ExitCode.OK


def _tokenize(args: argparse.Namespace) -> ExitCode:
    from goodput.data import tokenize
    from goodput.launch.env import launcher_rank

    rank, world_size = launcher_rank(os.environ)
    job = tokenize.TokenizeJob(
        inputs=args.inputs,
        tokenizer=args.tokenizer,
        tokenizer_kind=args.tokenizer_kind,
        output=args.output,
        name=_stem(args.inputs[0]) if args.name is None else args.name,
        num_workers=args.workers,
        shard_size_mb=args.shard_size_mb,
        text_field=args.text_field,
        pack_seq_len=args.pack_seq_len,
        rank=rank,
        world_size=world_size,
    )
    manifest = tokenize.run(job)
    if manifest is not None:
        print(
            f"{args.output / (job.name + '.manifest.json')}: {len(manifest['shards'])} shards, "
            f"{manifest['num_documents']:,} documents, {manifest['num_tokens']:,} tokens, "
            f"{manifest['num_empty_skipped']:,} empty documents skipped"
        )
    return ExitCode.OK


def _stem(path: Path) -> str:
    from goodput.io import resolved

    name = resolved(path).name
    for suffix in (".gz", ".zst", ".jsonl", ".parquet", ".txt"):
        name = name.removesuffix(suffix)
    return name


def _inspect(args: argparse.Namespace) -> ExitCode:
    from goodput.data.inspect import describe, format_description
    from goodput.io import print_json

    info = describe(args.path, args.tokenizer)
    if args.json:
        print_json(info, where="goodput data inspect --json", indent=2)
    else:
        print(format_description(info))
    return ExitCode.OK if not info["problems"] else ExitCode.ERROR


def _blend(args: argparse.Namespace) -> ExitCode:
    from goodput.data.blend import BlendSpec, BlendStage, build_blend, format_report
    from goodput.io import print_json

    spec = BlendSpec(
        stages=(BlendStage(args.file_list, 0), *args.stage),
        seq_len=args.seq_len,
        num_samples=args.num_samples,
        seed=args.seed,
        cache=args.cache,
        holdout_samples=args.holdout_samples,
        on_exhausted=args.on_exhausted,
        report_batch_size=args.report_batch_size,
        step_samples=args.step_samples,
    )
    directory, manifest = build_blend(spec)
    if args.json:
        print_json(manifest, where="goodput data blend --json", indent=2)
    else:
        print(format_report(directory, manifest))
    return ExitCode.OK


def _stage(text: str) -> BlendStage:
    """``START_SAMPLE:FILE_LIST`` of ``--stage``: a whole number >= 1 and a path (checked to
    exist with the schedule, ``stages.check_stages``, so that a line of the docs parses
    anywhere)."""
    from goodput.data.stages import BlendStage

    start, separator, file_list = text.partition(":")
    if not separator or not file_list:
        raise argparse.ArgumentTypeError(f"{text!r} is not START_SAMPLE:FILE_LIST")
    try:
        start_sample = argtypes.integer(1)(start)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: START_SAMPLE {error}") from None
    return BlendStage(Path(file_list), start_sample)


def _verify(args: argparse.Namespace) -> ExitCode:
    from goodput.data.manifest import verify_dataset, verify_run

    path = args.path / "blend.json" if args.path.is_dir() else args.path
    problems = verify_dataset(path) if path.name.endswith(".manifest.json") else verify_run(path)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{path}: {'FAILED, ' + str(len(problems)) + ' problem(s)' if problems else 'ok'}")
    return ExitCode.ERROR if problems else ExitCode.OK
