"""``goodput plan layout`` through the real CLI: what it reads from a config, its JSON, one-line
errors (exit 2 for bad input, 1 when nothing fits), and the examples of docs/plan.md, run as
written and compared with the output the page shows."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from goodput import cli
from goodput.testing.jobs import REPO

MACHINE = ["--nodes", "8", "--gpus-per-node", "12", "--gpu-mem-gb", "64"]
BATCH = ["--gbs-tokens", "1572864", "--seq-len", "4096"]


def run(capsys, *argv: object) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``goodput plan layout ARGV`` run in the repository."""
    here = os.getcwd()
    os.chdir(REPO)
    try:
        code = cli.main(["plan", "layout", *map(str, argv)])
    except SystemExit as exit_:  # argparse refuses a bad option itself
        code = int(exit_.code or 0)
    finally:
        os.chdir(here)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_20b_example_ends_with_the_layout_to_paste(capsys):
    code, out, err = run(capsys, "configs/llama-20b.toml", *MACHINE, *BATCH)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[2] == "ladder:" and lines[3].startswith("  DP    dp_replicate 96: 336.6 GiB")
    assert "chosen: FSDP dp_replicate 2 x dp_shard 48: 63.2 GiB per device of 64.0 GiB" in out
    assert lines[-1] == (
        "overrides: parallel.dp_replicate=2 parallel.dp_shard=48 parallel.tp=1 parallel.pp=1 "
        "parallel.cp=1 parallel.ep=1 parallel.sync_every_micro_batch=true"
    )


def test_json_is_one_object_with_the_documented_keys(capsys):
    code, out, _ = run(capsys, "configs/llama-80b.toml", *MACHINE, *BATCH, "--json")
    assert code == 0
    record = json.loads(out)
    assert list(record) == [
        "layout",
        "rung",
        "memory_gib_per_device",
        "device_gib",
        "breakdown_gib",
        "stage",
        "accumulation",
        "sync_every_micro_batch",
        "rejected",
        "warnings",
        "overrides",
    ]
    assert record["layout"] == {
        "dp_replicate": 1,
        "dp_shard": 24,
        "tp": 4,
        "pp": 1,
        "cp": 1,
        "ep": 1,
    }
    assert record["memory_gib_per_device"] == pytest.approx(sum(record["breakdown_gib"].values()))
    assert [r["rung"] for r in record["rejected"]] == ["DP"] + ["FSDP"] * 4 + ["TP"] * 8
    assert all(
        set(r) == {"rung", "layout", "memory_gib_per_device", "reason"} for r in record["rejected"]
    )
    assert record["overrides"].startswith(
        " ".join(f"parallel.{k}={v}" for k, v in record["layout"].items())
    )


def test_train_and_parallel_tables_fill_what_the_options_leave(capsys, tmp_path):
    # tiny-cpu.toml: tokens_per_step 4096, seq_len 128, micro_batch_size 8, precision fp32.
    code, out, _ = run(
        capsys, "configs/tiny-cpu.toml", "--nodes", 1, "--gpus-per-node", 4, "--gpu-mem-gb", 16
    )
    assert code == 0
    assert (
        "global batch 4,096 tokens = 32 x 128; micro-batch 8; fp32; activation checkpointing off"
        in out
    )
    assert out.splitlines()[-1].endswith("parallel.ep=1 parallel.precision=fp32")
    code, out, _ = run(
        capsys,
        "configs/tiny-cpu.toml",
        *("--nodes", 1, "--gpus-per-node", 4, "--gpu-mem-gb", 16),
        *("--gbs-tokens", 2048, "--seq-len", 64, "--micro-batch-size", 2),
        *("--precision", "pure-bf16", "--activation-checkpointing"),
    )
    assert (
        "global batch 2,048 tokens = 32 x 64; micro-batch 2; pure-bf16; activation checkpointing on"
        in out
    )
    config = tmp_path / "run.toml"
    config.write_text((REPO / "configs/llama-20b.toml").read_text() + "\n[parallel]\ntp = 16\n")
    code, out, _ = run(capsys, config, *MACHINE, *BATCH)
    assert code == 0
    assert out.splitlines()[-1].startswith(
        "warning: the config's [parallel]: tp = 16 does not divide the 12 ranks per host"
    )


def test_nothing_fits_is_one_line_and_exit_1(capsys):
    code, out, err = run(capsys, "configs/llama-80b.toml", "--nodes", 2, *MACHINE[2:], *BATCH)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith(
        "goodput: error: configs/llama-80b.toml: no layout fits: the smallest estimate is 78.5 GiB"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.toml", *MACHINE, *BATCH], "missing.toml"),
        (["BAD", *MACHINE, *BATCH], "invalid TOML"),
        (["UNKNOWN_MODEL_KEY", *MACHINE, *BATCH], "unknown key 'model.dims'"),
        (["UNKNOWN_TRAIN_KEY", *MACHINE, *BATCH], "unknown key 'train.seqlen'"),
        (["ZERO_SEQ_LEN", *MACHINE, "--gbs-tokens", "4096"], "'train.seq_len' = 0 is not in"),
        (["NO_MODEL", *MACHINE, *BATCH], "no [model] table"),
        (["configs/llama-20b.toml", *MACHINE], "--gbs-tokens: no global batch"),
        (
            ["configs/llama-20b.toml", *MACHINE, "--gbs-tokens", "1000"],
            "not a multiple of seq_len 8192",
        ),
        (
            ["configs/llama-20b.toml", *MACHINE, *BATCH[:2], "--seq-len", "9000"],
            "exceeds model.max_seq_len",
        ),
        (
            ["configs/llama-20b.toml", "--nodes", "0", *MACHINE[2:], *BATCH],
            "argument --nodes: 0 is not in",
        ),
        (["configs/llama-20b.toml", "--nodes", "-2", *MACHINE[2:], *BATCH], "argument --nodes"),
        (
            ["configs/llama-20b.toml", "--nodes", "2.5", *MACHINE[2:], *BATCH],
            "'2.5' is not a whole number",
        ),
        (["configs/llama-20b.toml", *MACHINE[:4], "--gpu-mem-gb", "nan", *BATCH], "--gpu-mem-gb"),
        (["configs/llama-20b.toml", *MACHINE[:4], "--gpu-mem-gb", "0", *BATCH], "--gpu-mem-gb"),
        (["configs/llama-20b.toml", *MACHINE, *BATCH, "--precision", "fp8"], "invalid choice"),
        (["configs/llama-20b.toml", *MACHINE[2:], *BATCH], "--nodes"),
        (
            ["configs/llama-20b.toml", "--nodes", "1000000", *MACHINE[2:], *BATCH],
            "beyond any machine",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
    configs = {
        "BAD": "[model\nvocab_size = 3\n",
        "UNKNOWN_MODEL_KEY": "[model]\nvocab_size = 8\ndims = 8\n",
        "UNKNOWN_TRAIN_KEY": (REPO / "configs/llama-20b.toml").read_text()
        + "[train]\nseqlen = 4\n",
        "ZERO_SEQ_LEN": (REPO / "configs/llama-20b.toml").read_text() + "[train]\nseq_len = 0\n",
        "NO_MODEL": "[train]\nseq_len = 4\n",
    }
    if argv[0] in configs:
        path = tmp_path / f"{argv[0]}.toml"
        path.write_text(configs[argv[0]])
        argv = [str(path), *argv[1:]]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("goodput: error: ") and message in err
    assert "Traceback" not in err


def doc_examples() -> list[tuple[str, str]]:
    """(command line, the output the page shows) for each ``goodput plan layout`` block of
    docs/plan.md that an output block follows."""
    text = (REPO / "docs" / "plan.md").read_text()
    pairs = re.findall(
        r"```sh\n(goodput plan layout [^\n]*)\n```\n+```(?:json|text)?\n(.*?)```", text, re.S
    )
    return [(line, output) for line, output in pairs]


def test_the_page_shows_examples():
    lines = [line for line, _ in doc_examples()]
    assert len(lines) >= 4
    assert any("llama-20b" in line for line in lines) and any(
        "llama-405b" in line for line in lines
    )
    assert any("--json" in line for line in lines)


@pytest.mark.parametrize(("line", "shown"), doc_examples(), ids=lambda value: str(value)[:60])
def test_the_pages_examples_print_what_it_shows(capsys, line, shown):
    code, out, err = run(capsys, *shlex.split(line)[3:])
    assert (out + err).strip() == shown.strip()
    assert code == (1 if err else 0)
