"""The pipeline as a user runs it: `python -m goodput.demo` and the CLI in real processes."""

import json
import os
import subprocess
import sys

import pytest


def goodput(*args, env=None, check=True):
    result = subprocess.run(
        [sys.executable, "-m", "goodput.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    result = subprocess.run(
        [sys.executable, "-m", "goodput.demo", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return out, result.stdout


def test_demo_runs_every_stage_and_reports_the_mixture(demo):
    out, stdout = demo
    for command in ("demo-corpus", "train-tokenizer", "tokenize", "inspect", "blend", "verify"):
        assert f"$ goodput data {command}" in stdout
    assert "target  achieved" in stdout and "REPEATED" in stdout
    assert "blend.json: ok" in stdout and "first global batch: input_ids (8, 256)" in stdout
    for domain in ("code", "docs", "docstrings"):
        manifest = json.loads((out / "shards" / f"{domain}.manifest.json").read_text())
        assert manifest["num_documents"] > 50 and manifest["dtype"] == "uint16"


def test_verify_names_a_changed_shard(demo, tmp_path):
    out, _ = demo
    blend_dir = next(p for p in (out / "cache" / "blends").iterdir() if p.is_dir())
    shard = out / "shards" / "docs_00000.bin"
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[:10] + bytes([original[10] ^ 1]) + original[11:])
        result = goodput("data", "verify", blend_dir, check=False)
        assert result.returncode == 1
        assert f"{shard}: checksum mismatch" in result.stderr and "FAILED" in result.stdout
    finally:
        shard.write_bytes(original)
    assert goodput("data", "verify", blend_dir).returncode == 0


def test_ranks_from_the_launcher_environment_split_the_work(demo, tmp_path):
    out, _ = demo
    corpus, tokenizer = out / "corpus", out / "tokenizer.model"
    argv = [
        sys.executable,
        "-m",
        "goodput.cli",
        "data",
        "tokenize",
        str(corpus),
        "--tokenizer",
        str(tokenizer),
        "--output",
        str(tmp_path / "ranked"),
        "--name",
        "all",
        "--shard-size-mb",
        "1",
        "--workers",
        "1",
    ]
    ranks = [
        subprocess.Popen(
            argv,
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    goodput(
        "data",
        "tokenize",
        corpus,
        "--tokenizer",
        tokenizer,
        "--output",
        tmp_path / "single",
        "--name",
        "all",
        "--shard-size-mb",
        "1",
        "--workers",
        "2",
    )
    ranked = json.loads((tmp_path / "ranked" / "all.manifest.json").read_text())
    single = json.loads((tmp_path / "single" / "all.manifest.json").read_text())
    assert len(ranked["shards"]) == 2  # code alone; docs + docstrings share a unit
    assert ranked["shards"] == single["shards"] and ranked["job_key"] == single["job_key"]


def test_verify_names_a_changed_tokenizer(demo):
    out, _ = demo
    blend_dir = next(p for p in (out / "cache" / "blends").iterdir() if p.is_dir())
    tokenizer = out / "tokenizer.model"
    original = tokenizer.read_bytes()
    try:
        tokenizer.write_bytes(original + b"\0")
        result = goodput("data", "verify", blend_dir, check=False)
        assert result.returncode == 1
        assert f"{tokenizer}: tokenizer file changed since it was pinned" in result.stderr
    finally:
        tokenizer.write_bytes(original)
