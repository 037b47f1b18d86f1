"""``goodput generate``: continue a prompt with a checkpoint's model, as a quick sanity check of
what it learned; one call of ``goodput.eval.generate.generate_from_checkpoint``, on the device
goodput detects (``GOODPUT_DEVICE`` overrides it): in one process, or once per rank under
``goodput launch --nproc N -- goodput generate ...`` (the model sharded over them, rank 0
printing)."""

from __future__ import annotations

import argparse
from pathlib import Path

from goodput import argtypes
from goodput.commands import Subparsers
from goodput.errors import ExitCode

MAX_NEW_TOKENS = 65_536  # goodput.eval.generate.MAX_NEW_TOKENS, without importing torch here


def register(groups: Subparsers) -> None:
    generate = groups.add_parser(
        "generate",
        help="continue a prompt with a checkpoint's model (greedy or top-p sampling, KV cache)",
        description="Load a checkpoint (or a run directory's newest complete one) and print the "
        "continuation of --prompt: whole in this process, or sharded over the ranks of goodput "
        "launch. Stops at the end-of-document token, "
        "after --max-new-tokens, or when the model's max_seq_len is full.",
    )
    generate.set_defaults(handler=_generate)
    generate.add_argument(
        "checkpoint",
        type=Path,
        metavar="CHECKPOINT",
        help="a checkpoint directory (RUN/checkpoints/step-N) or a run directory (its newest "
        "complete checkpoint)",
    )
    generate.add_argument("--prompt", required=True, help="the text to continue (UTF-8)")
    generate.add_argument(
        "--max-new-tokens",
        type=argtypes.positive_int,
        default=64,
        metavar="N",
        help=f"stop after N new tokens (default 64, at most {MAX_NEW_TOKENS:,})",
    )
    generate.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="sampling temperature, any finite number >= 0; 0 (the default) is greedy, a tiny "
        "one greedy in effect, a huge one uniform",
    )
    generate.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="sample from the smallest set of tokens holding probability P, in (0, 1] "
        "(default 1.0: all)",
    )
    generate.add_argument(
        "--seed", type=argtypes.non_negative_int, default=0, help="sampling seed (default 0)"
    )
    generate.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="the tokenizer file (default: the one the run's blend pins, checked by its sha256)",
    )
    generate.add_argument(
        "--json",
        action="store_true",
        help='print one object {"prompt", "completion", "tokens", "num_new_tokens", "stopped"}',
    )


def _generate(args: argparse.Namespace) -> ExitCode:
    from goodput.eval.generate import Sampling, generate_from_checkpoint
    from goodput.io import print_json

    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    result = generate_from_checkpoint(
        args.checkpoint,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        tokenizer_path=args.tokenizer,
    )
    if result is None:  # a rank other than 0 of a launch: rank 0 prints
        return ExitCode.OK
    if args.json:
        print_json(result, where="goodput generate --json")
    else:
        print(result["completion"], flush=True)
    return ExitCode.OK
