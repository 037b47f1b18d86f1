"""``make demo``: the whole data pipeline on the embedded corpus, on CPU, through the real CLI.

Each step is the command a user would type (printed before it runs), so the demo doubles as a
walkthrough. Steps whose output is already complete are cheap to rerun: tokenize resumes and
blend hits its cache.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from goodput import cli
from goodput.data.blend import BlendSpec, build_blend, format_report
from goodput.data.loader import DataLoader
from goodput.io import write_text

DEMO_WEIGHTS = {"code": 0.5, "docstrings": 0.3, "docs": 0.2}
VOCAB_SIZE = 4096
SEQ_LEN = 256
NUM_SAMPLES = 16_000
SEED = 1234


def run(argv: list[str]) -> None:
    print(f"\n$ goodput {shlex.join(argv)}", flush=True)
    code = cli.main(argv)
    if code:
        sys.exit(code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=Path("demo"))
    out = parser.parse_args().output
    corpus, shards, tokenizer = out / "corpus", out / "shards", out / "tokenizer.model"
    run(["data", "demo-corpus", "--output", str(corpus)])
    if not tokenizer.exists():
        run(
            [
                "data",
                "train-tokenizer",
                str(corpus),
                "--vocab-size",
                str(VOCAB_SIZE),
                "--output",
                str(tokenizer),
            ]
        )
    for domain in DEMO_WEIGHTS:
        run(
            [
                "data",
                "tokenize",
                str(corpus / domain),
                "--tokenizer",
                str(tokenizer),
                "--output",
                str(shards),
                "--name",
                domain,
                "--workers",
                "2",
            ]
        )
    run(["data", "inspect", str(shards / "docs.manifest.json")])
    file_list = out / "file_list.txt"
    write_text(
        file_list,
        "# weight path-prefix corpus\n"
        + "".join(
            f"{weight} shards/{domain}_00000 {domain}\n" for domain, weight in DEMO_WEIGHTS.items()
        ),
    )
    spec = BlendSpec(
        file_list=file_list,
        seq_len=SEQ_LEN,
        num_samples=NUM_SAMPLES,
        seed=SEED,
        output=out / "cache",
    )
    print(
        f"\n$ goodput data blend {file_list} --seq-len {SEQ_LEN} --num-samples {NUM_SAMPLES} "
        f"--seed {SEED} --output {spec.output}",
        flush=True,
    )
    blend_dir, manifest = build_blend(spec)  # what the command runs; we need its directory
    print(format_report(blend_dir, manifest))
    run(["data", "verify", str(blend_dir)])
    loader = DataLoader(blend_dir, global_batch_size=8, dp_rank=0, dp_size=1)
    input_ids, labels = next(iter(loader))
    print(
        f"\nfirst global batch: input_ids {tuple(input_ids.shape)}, labels "
        f"{tuple(labels.shape)}; loader state {loader.state_dict()['consumed_samples']} "
        "samples consumed"
    )


if __name__ == "__main__":
    main()
