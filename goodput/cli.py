"""The ``goodput`` command: one dispatcher, a subcommand group per part, no business logic.

Every handler returns an ``ExitCode``. A ``GoodputError`` becomes one line on stderr and its
exit code; argparse usage errors exit 2. Heavy modules are imported inside handlers so that
``goodput --help`` stays instant.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from goodput import __version__, argtypes
from goodput.errors import ExitCode, GoodputError, from_exception

Handler = Callable[[argparse.Namespace], ExitCode]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="goodput", description="Pre-train LLMs on supercomputers and keep the run alive."
    )
    parser.add_argument("--version", action="version", version=f"goodput {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (or GOODPUT_DEBUG=1)"
    )
    groups = parser.add_subparsers(dest="group", required=True, metavar="GROUP")
    data = groups.add_parser(
        "data",
        help="tokenize once, blend by weight, pin everything",
        description="The data pipeline: demo-corpus -> train-tokenizer -> "
        "tokenize -> blend -> verify.",
    )
    commands = data.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_data_commands(commands)
    model = groups.add_parser(
        "model", help="inspect model configs", description="Model configs: sizes, FLOPs, memory."
    )
    model_commands = model.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = model_commands.add_parser(
        "info",
        help="parameters (total/active), FLOPs per token and training memory per "
        "precision policy of the [model] table of a config",
        description="Parameters (total/active), FLOPs per token (6N + attention term) and "
        "training memory per parameter for each precision policy. Allocates nothing.",
    )
    info.add_argument("config", type=Path, help="a TOML file with a [model] table")
    info.add_argument("overrides", nargs="*", help="key=value overrides inside [model]")
    info.add_argument(
        "--seq-len", type=argtypes.positive_int, help="default: the config's max_seq_len"
    )
    info.add_argument("--json", action="store_true")
    info.set_defaults(handler=_model_info)
    train = groups.add_parser(
        "train",
        help="train a model from a run config (single process or under any launcher)",
        description="Train from a TOML run config with [model] [train] [data] [optim] "
        "[schedule] [parallel] tables. Runs as one process, or as every rank under torchrun, "
        "srun or mpiexec; prints one step=N line per step.",
    )
    train.add_argument("config", type=Path, help="the run config (TOML)")
    train.add_argument(
        "overrides", nargs="*", help="section.key=value overrides, e.g. train.steps=100"
    )
    train.add_argument(
        "--resume",
        metavar="auto|never|PATH",
        help="auto: the newest complete checkpoint of the run, if any (default); never: start "
        "fresh; PATH: that checkpoint directory (same as checkpoint.resume=...)",
    )
    train.add_argument(
        "--allow-data-change",
        action="store_true",
        help="resume even though the data fingerprint differs from the checkpoint's",
    )
    train.set_defaults(handler=_train)
    ckpt = groups.add_parser(
        "ckpt",
        help="list checkpoints; convert them to and from HuggingFace Llama and .pt files",
        description="Checkpoints of a run: list them, export a step to a HuggingFace Llama "
        "folder or a single .pt state dict, and import either as a model-only checkpoint that "
        "`goodput train --resume` starts from. Runs offline, in one process.",
    )
    ckpt_commands = ckpt.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_ckpt_commands(ckpt_commands)
    _add_launch_parser(groups)
    _add_broadcast_parser(groups)
    _add_submit_parser(groups)
    return parser


def _add_launch_parser(groups: argparse._SubParsersAction) -> None:
    launch = groups.add_parser(
        "launch",
        help="run a command on the job's hosts (srun, mpiexec or local ranks), watch it, retry it",
        description="Run CMD as NPROC ranks: with srun inside a Slurm job, with mpiexec inside a "
        "PBS job, else as local processes with torchrun's variables. Stops every rank when one "
        "fails or all go quiet for --timeout seconds; retries up to --retries times.",
        usage="goodput launch [options] -- CMD ...",
    )
    launch.add_argument(
        "--nhosts",
        type=argtypes.positive_int,
        help="use the first N hosts of the job; the rest are spares",
    )
    launch.add_argument(
        "--ppn", type=argtypes.positive_int, help="ranks per host (default: the profile's)"
    )
    launch.add_argument(
        "--nproc", type=argtypes.positive_int, help="ranks in all (default: nhosts x ppn)"
    )
    launch.add_argument(
        "--profile",
        help="machine profile: generic, aurora, polaris, perlmutter, frontier, or a .toml path "
        "(default: $GOODPUT_PROFILE, else generic)",
    )
    launch.add_argument("--dry-run", action="store_true", help="print the command line(s) and exit")
    launch.add_argument(
        "--timeout",
        type=argtypes.non_negative_float,
        metavar="S",
        help="stop all ranks after S seconds without output (exit 124; default: never, 1800 "
        "with --auto-retry; 0: never)",
    )
    launch.add_argument(
        "--retries",
        type=argtypes.non_negative_int,
        help="attempts after a failed one (default 0; with --auto-retry: no limit but its own)",
    )
    launch.add_argument(
        "--backoff",
        type=argtypes.non_negative_float,
        default=5.0,
        metavar="S",
        help="seconds before the first retry, doubling up to 300, jittered (default 5)",
    )
    launch.add_argument(
        "--auto-retry",
        action="store_true",
        help="classify each failed attempt, replace bad hosts from the spares (--nhosts N of "
        "a larger job), probe hosts when no log line names one; stop after 2 attempts without "
        "a step, at walltime, on Ctrl-C or when spares run out (--timeout defaults to 1800)",
    )
    launch.add_argument(
        "--grace",
        type=argtypes.non_negative_float,
        default=10.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 10)",
    )
    launch.add_argument("--log", type=Path, help="also append all output to this file")
    launch.add_argument(
        "--run-dir",
        type=Path,
        help="where attempts.jsonl and the PBS host file go (default: the --log file's "
        "folder, else ./launch-JOBID)",
    )
    launch.add_argument(
        "--no-prefix", action="store_true", help="do not prefix output lines with [rank]"
    )
    launch.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    launch.set_defaults(handler=_launch)


def _add_broadcast_parser(groups: argparse._SubParsersAction) -> None:
    sub = groups.add_parser(
        "broadcast",
        help="copy a venv or any folder to a node-local path on every host, by a greedy tree",
        description="Copy SOURCE to DEST on every host: each host that has finished becomes a "
        "source, each source serves at most --fanout copies at once, failed copies are retried. "
        "With --checkpoint RUN_DIR, copy the run's newest complete checkpoint to DEST/step-N "
        "instead (older step-N there are removed after), for [checkpoint] local_dir = DEST. "
        "With --simulate, print the predicted makespan of the tree and of a star instead.",
        usage="goodput broadcast SOURCE (--hosts H,...|--hostfile FILE) --dest PATTERN [options]\n"
        "       goodput broadcast --checkpoint RUN_DIR (--hosts H,...|--hostfile FILE) "
        "--dest PATTERN [options]\n"
        "       goodput broadcast --simulate --nodes N --copy-seconds T [--fanout K]",
    )
    sub.add_argument("source", nargs="?", type=Path, help="the folder to copy")
    sub.add_argument(
        "--checkpoint",
        type=Path,
        metavar="RUN_DIR",
        help="stage the newest complete checkpoint of this run (or checkpoint folder) instead",
    )
    sub.add_argument("--hosts", help="comma-separated host names")
    sub.add_argument("--hostfile", type=Path, help="a file of host names, one a line")
    sub.add_argument(
        "--dest",
        help="the node-local path; {host} is replaced by the host name (needed for local)",
    )
    sub.add_argument(
        "--transport", default="rsync", help="local, rsync or tar (over ssh; default rsync)"
    )
    sub.add_argument(
        "--ssh-config",
        type=Path,
        metavar="FILE",
        help="ssh client config (ssh -F) for rsync and tar, for every hop; same path on all hosts",
    )
    sub.add_argument(
        "--fanout",
        type=argtypes.positive_int,
        default=8,
        help="copies one source serves at once (default 8)",
    )
    sub.add_argument(
        "--retries",
        type=argtypes.non_negative_int,
        default=2,
        help="retries of a failed copy (default 2)",
    )
    sub.add_argument(
        "--min-success",
        type=argtypes.positive_int,
        help="fail unless this many hosts succeed (default: all)",
    )
    sub.add_argument("--simulate", action="store_true", help="predict makespans, copy nothing")
    sub.add_argument("--nodes", type=argtypes.positive_int, help="hosts to simulate")
    sub.add_argument(
        "--copy-seconds",
        type=argtypes.non_negative_float,
        help="seconds one copy takes, to simulate",
    )
    sub.set_defaults(handler=_broadcast)


def _add_submit_parser(groups: argparse._SubParsersAction) -> None:
    sub = groups.add_parser(
        "submit",
        help="write (and --submit) a Slurm or PBS job chain that reruns a goodput launch line, "
        "one allocation after another, until the run is done",
        description="Write RUN_DIR/chain.sbatch (Slurm) or RUN_DIR/chain.pbs (PBS). Each job "
        "queues its successor (after-any dependency) before it runs the launch line, so a "
        "walltime kill still leaves the next job queued; the chain stops once the trainer has "
        "written RUN_DIR/done, or after --max-jobs jobs. The jobs run in the environment you "
        "submit from.",
        usage="goodput submit --run-dir DIR --nodes N --time HH:MM:SS [options] "
        "-- goodput launch [launch options] -- CMD ...",
    )
    sub.add_argument(
        "--run-dir",
        type=Path,
        required=True,
        help="the run's output folder (train.output): the script, Slurm's job logs and the done "
        "marker live here",
    )
    sub.add_argument("--nodes", type=argtypes.positive_int, required=True, help="nodes per job")
    sub.add_argument("--time", required=True, metavar="HH:MM:SS", help="walltime per job")
    sub.add_argument(
        "--scheduler",
        choices=["slurm", "pbs"],
        help="default: the one installed (sbatch: slurm, qsub: pbs)",
    )
    sub.add_argument("--job-name", help="default: the run dir's name")
    sub.add_argument("--account", help="Slurm --account, PBS -A (the project)")
    sub.add_argument("--partition", "--queue", dest="queue", help="Slurm partition, PBS queue")
    sub.add_argument("--filesystems", help="PBS -l filesystems=, e.g. home:flare on Aurora")
    sub.add_argument(
        "--max-jobs",
        type=argtypes.positive_int,
        default=10,
        help="jobs in the chain at most (default 10)",
    )
    sub.add_argument(
        "--submit",
        action="store_true",
        help="queue the first job and print its id (default: print the script's path)",
    )
    sub.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- goodput launch ...")
    sub.set_defaults(handler=_submit)


def _add_data_commands(commands: argparse._SubParsersAction) -> None:
    def add(name: str, handler: Handler, help_: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_, description=help_)
        sub.set_defaults(handler=handler)
        return sub

    sub = add(
        "demo-corpus",
        _demo_corpus,
        "write the embedded multi-domain corpus (code, docs, "
        "docstrings from this Python's standard library) as JSONL, one folder per domain",
    )
    sub.add_argument("--output", type=Path, required=True, help="directory to write into")

    sub = add(
        "train-tokenizer",
        _train_tokenizer,
        "train a SentencePiece model on raw inputs (deterministic settings)",
    )
    sub.add_argument("inputs", nargs="+", type=Path, help="files or folders of documents")
    sub.add_argument("--vocab-size", type=argtypes.positive_int, required=True)
    sub.add_argument("--output", type=Path, required=True, help="the .model file to write")
    sub.add_argument("--text-field", default="text", help="JSON field holding the text")

    sub = add(
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

    sub = add(
        "inspect",
        _inspect,
        "show a shard or dataset: documents, tokens, dtype, the "
        "first document, and verify checksums against the manifest",
    )
    sub.add_argument("path", type=Path, help="a shard prefix/.bin/.idx or a NAME.manifest.json")
    sub.add_argument("--tokenizer", type=Path, help="decode the first document with it")
    sub.add_argument("--json", action="store_true", help="machine-readable output")

    sub = add(
        "blend",
        _blend,
        "build the weighted, deterministic blend index from a file list "
        "of 'weight path-prefix corpus' lines and print the mixture report",
    )
    sub.add_argument("file_list", type=Path)
    sub.add_argument("--seq-len", type=argtypes.positive_int, required=True)
    sub.add_argument(
        "--num-samples",
        type=argtypes.positive_int,
        required=True,
        help="global samples of seq_len+1 tokens (steps x global batch)",
    )
    sub.add_argument("--seed", type=argtypes.non_negative_int, required=True)
    sub.add_argument(
        "--output",
        type=Path,
        required=True,
        help="cache directory; the blend lands in OUTPUT/blends/<fingerprint>",
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
    sub.add_argument("--json", action="store_true", help="print the run manifest as JSON")

    sub = add(
        "verify",
        _verify,
        "re-check pinned data: a blend directory (its fingerprint, "
        "every shard's checksum, the tokenizer) or a dataset manifest",
    )
    sub.add_argument("path", type=Path, help="a blend directory, blend.json or *.manifest.json")


def _add_ckpt_commands(commands: argparse._SubParsersAction) -> None:
    def add(name: str, handler: Handler, help_: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_, description=help_)
        sub.set_defaults(handler=handler)
        return sub

    sub = add(
        "list",
        _ckpt_list,
        "every step-N checkpoint of a run: complete or not, size on disk, age, and which one "
        "'latest' names",
    )
    sub.add_argument("run_dir", type=Path, help="the run directory holding checkpoints/")
    sub.add_argument("--json", action="store_true", help="machine-readable output")

    sub = add(
        "export-hf",
        _ckpt_export_hf,
        "write a complete checkpoint as a HuggingFace LlamaForCausalLM folder "
        "(config.json + model.safetensors, fp32); dense models only",
    )
    sub.add_argument("step_dir", type=Path, help="a checkpoint directory, RUN/checkpoints/step-N")
    sub.add_argument("out_dir", type=Path, help="the folder to create (must not hold anything)")

    sub = add(
        "import-hf",
        _ckpt_import_hf,
        "turn a HuggingFace Llama folder (config.json + safetensors, single or sharded) into "
        "a model-only checkpoint OUT_DIR/checkpoints/step-00000000",
    )
    sub.add_argument("hf_dir", type=Path, help="the HuggingFace model folder")
    sub.add_argument("out_dir", type=Path, help="the run directory to write the checkpoint into")

    sub = add(
        "to-torch",
        _ckpt_to_torch,
        "write the consolidated model state dict of a complete checkpoint as one torch.save "
        "file of plain tensors (torch.load(..., weights_only=True) reads it)",
    )
    sub.add_argument("step_dir", type=Path, help="a checkpoint directory, RUN/checkpoints/step-N")
    sub.add_argument("file", type=Path, help="the .pt file to create")

    sub = add(
        "from-torch",
        _ckpt_from_torch,
        "turn a .pt state dict (read with weights_only=True) and a config's [model] table into "
        "a model-only checkpoint OUT_DIR/checkpoints/step-00000000",
    )
    sub.add_argument("file", type=Path, help="a .pt file holding the model's state dict")
    sub.add_argument("config", type=Path, help="a TOML file whose [model] table fits the weights")
    sub.add_argument("out_dir", type=Path, help="the run directory to write the checkpoint into")


def _demo_corpus(args: argparse.Namespace) -> ExitCode:
    from goodput.data.corpus import build_demo_corpus

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
    name = path.resolve().name
    for suffix in (".gz", ".zst", ".jsonl", ".parquet", ".txt"):
        name = name.removesuffix(suffix)
    return name


def _inspect(args: argparse.Namespace) -> ExitCode:
    from goodput.data.inspect import describe, format_description

    info = describe(args.path, args.tokenizer)
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return ExitCode.OK if not info["problems"] else ExitCode.ERROR


def _blend(args: argparse.Namespace) -> ExitCode:
    from goodput.data.blend import BlendSpec, build_blend, format_report

    spec = BlendSpec(
        file_list=args.file_list,
        seq_len=args.seq_len,
        num_samples=args.num_samples,
        seed=args.seed,
        output=args.output,
        on_exhausted=args.on_exhausted,
        report_batch_size=args.report_batch_size,
    )
    directory, manifest = build_blend(spec)
    print(json.dumps(manifest, indent=2) if args.json else format_report(directory, manifest))
    return ExitCode.OK


def _verify(args: argparse.Namespace) -> ExitCode:
    from goodput.data.manifest import verify_dataset, verify_run

    path = args.path / "blend.json" if args.path.is_dir() else args.path
    problems = verify_dataset(path) if path.name.endswith(".manifest.json") else verify_run(path)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{path}: {'FAILED, ' + str(len(problems)) + ' problem(s)' if problems else 'ok'}")
    return ExitCode.ERROR if problems else ExitCode.OK


def _model_info(args: argparse.Namespace) -> ExitCode:
    from goodput.config import load_section
    from goodput.train.info import describe, format_description
    from goodput.train.model import ModelConfig

    cfg = load_section(ModelConfig, args.config, "model", args.overrides)
    info = describe(cfg, args.seq_len or cfg.max_seq_len)
    print(json.dumps(info, indent=2) if args.json else format_description(str(args.config), info))
    return ExitCode.OK


def _train(args: argparse.Namespace) -> ExitCode:
    from goodput.config import load_config
    from goodput.train.config import RunConfig
    from goodput.train.loop import train

    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={json.dumps(args.resume)}")
    if args.allow_data_change:
        overrides.append("checkpoint.allow_data_change=true")
    cfg = load_config(RunConfig, args.config, overrides)
    try:
        train(cfg)
    except Exception as error:
        # The line names the rank and its host, for the person reading the log and for
        # `goodput launch --auto-retry`, which swaps the host out on a device error.
        raise from_exception(error, context=_rank_on_host()) from error
    return ExitCode.OK


def _rank_on_host() -> str:
    from goodput.launch.env import current_placement

    try:
        rank = str(current_placement().rank)
    except GoodputError:
        rank = "?"
    return f"rank {rank} on {socket.gethostname()}"


def _ckpt_list(args: argparse.Namespace) -> ExitCode:
    from goodput.checkpoint.listing import describe_checkpoints, format_checkpoints

    info = describe_checkpoints(args.run_dir)
    print(json.dumps(info, indent=2) if args.json else format_checkpoints(info))
    return ExitCode.OK


def _ckpt_export_hf(args: argparse.Namespace) -> ExitCode:
    from goodput.checkpoint.convert import export_hf

    print(f"{export_hf(args.step_dir, args.out_dir)}: HuggingFace Llama folder written")
    return ExitCode.OK


def _ckpt_import_hf(args: argparse.Namespace) -> ExitCode:
    from goodput.checkpoint.convert import import_hf

    directory = import_hf(args.hf_dir, args.out_dir)
    print(f"{directory}: complete (model only); start from it with --resume {directory}")
    return ExitCode.OK


def _ckpt_to_torch(args: argparse.Namespace) -> ExitCode:
    from goodput.checkpoint.convert import to_torch

    print(f"{to_torch(args.step_dir, args.file)}: model state dict written")
    return ExitCode.OK


def _ckpt_from_torch(args: argparse.Namespace) -> ExitCode:
    from goodput.checkpoint.convert import from_torch

    directory = from_torch(args.file, args.config, args.out_dir)
    print(f"{directory}: complete (model only); start from it with --resume {directory}")
    return ExitCode.OK


def _launch(args: argparse.Namespace) -> ExitCode:
    from goodput.launch import LaunchOptions, run

    options = LaunchOptions(
        command=tuple(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd),
        nhosts=args.nhosts,
        ppn=args.ppn,
        nproc=args.nproc,
        profile=args.profile,
        idle_timeout_s=args.timeout,
        retries=args.retries,
        backoff_s=args.backoff,
        auto_retry=args.auto_retry,
        grace_s=args.grace,
        log=args.log,
        run_dir=args.run_dir,
        prefix=not args.no_prefix,
    )
    return run(options, dry_run=args.dry_run)


def _broadcast(args: argparse.Namespace) -> ExitCode:
    from goodput.launch import broadcast, transports

    if args.simulate:
        if args.nodes is None or args.copy_seconds is None:
            raise GoodputError.usage(
                "broadcast --simulate",
                "needs --nodes and --copy-seconds",
                "e.g. --simulate --nodes 10624 --copy-seconds 10",
            )
        tree, star = broadcast.simulate(args.nodes, args.copy_seconds, args.fanout)
        print(f"tree: {tree:.1f} s ({args.nodes} hosts, fanout {args.fanout})")
        print(f"star: {star:.1f} s")
        print(f"star/tree: {star / tree:.1f}x" if tree > 0 else "star/tree: n/a")
        return ExitCode.OK
    if args.checkpoint is not None:
        from goodput.launch import stage

        if args.source is not None or args.dest is None:
            raise GoodputError.usage(
                "broadcast --checkpoint",
                "takes --dest and no SOURCE",
                "e.g. goodput broadcast --checkpoint RUN_DIR --hostfile $PBS_NODEFILE "
                "--dest /local/scratch/ckpt",
            )
        hosts = broadcast.read_hosts(args.hosts, args.hostfile)
        staged = stage.stage_checkpoint(
            args.checkpoint,
            hosts,
            args.dest,
            lambda dest: transports.make_transport(args.transport, dest, args.ssh_config),
            fanout=args.fanout,
            retries=args.retries,
            min_success=args.min_success,
            progress=lambda line: print(line, file=sys.stderr),
        )
        print(stage.describe(staged, len(hosts)))
        return ExitCode.OK
    if args.source is None or args.dest is None:
        raise GoodputError.usage(
            "broadcast",
            "needs SOURCE and --dest",
            "e.g. goodput broadcast .venv --hostfile $PBS_NODEFILE --dest /tmp/.venv",
        )
    hosts = broadcast.read_hosts(args.hosts, args.hostfile)
    result = broadcast.broadcast(
        args.source,
        hosts,
        transport=transports.make_transport(args.transport, args.dest, args.ssh_config),
        fanout=args.fanout,
        retries=args.retries,
        min_success=args.min_success,
        progress=lambda line: print(line, file=sys.stderr),
    )
    by_origin = sum(copy.source == broadcast.ORIGIN for copy in result.copies)
    print(
        f"broadcast: {len(result.succeeded)} of {len(hosts)} hosts in {result.makespan_s:.1f} s "
        f"({by_origin} copies from the origin)"
        + (f"; failed: {', '.join(result.failed)}" if result.failed else "")
    )
    return ExitCode.OK  # below --min-success, broadcast() raised


def _submit(args: argparse.Namespace) -> ExitCode:
    from goodput.launch import submit

    launch_line = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    submit.check_launch_line(launch_line)
    # A typo in the launch options fails now (exit 2), not hours later when the job starts.
    launch, unknown = build_parser().parse_known_args(launch_line[1:])
    if unknown or launch.cmd in ([], ["--"]):
        raise GoodputError.usage(
            "submit --",
            f"goodput launch does not know {' '.join(unknown)}"
            if unknown
            else "the goodput launch line names no command",
            "see goodput launch --help; end the line with -- CMD, e.g. -- goodput train run.toml",
        )
    chain = submit.Chain(
        scheduler=args.scheduler or submit.detect_scheduler(),
        run_dir=args.run_dir.absolute(),
        workdir=Path.cwd(),
        launch_line=tuple(launch_line),
        nodes=args.nodes,
        walltime=args.time,
        job_name=args.job_name or submit.default_job_name(args.run_dir.absolute()),
        account=args.account,
        queue=args.queue,
        filesystems=args.filesystems,
        max_jobs=args.max_jobs,
    )
    script = submit.write_script(chain)
    if not args.submit:
        print(script)
        return ExitCode.OK
    job_id = submit.submit(chain)
    print(job_id)
    print(
        f"submit: job {job_id} queued from {script}; the chain goes on until {chain.done_marker} "
        f"exists, {chain.max_jobs} jobs at most",
        file=sys.stderr,
    )
    return ExitCode.OK


def main(argv: Sequence[str] | None = None) -> int:
    """The one boundary: whatever a command raises leaves as one line and a non-zero code."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `goodput ... | head` ends quietly
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print("goodput: interrupted", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)
    except Exception as exc:
        if args.debug or os.environ.get("GOODPUT_DEBUG") == "1":
            traceback.print_exc()
        error = from_exception(exc)
        print(f"goodput: error: {error.render()}", file=sys.stderr, flush=True)
        return int(error.code)


if __name__ == "__main__":
    sys.exit(main())
