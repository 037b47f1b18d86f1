"""Data-mix stages for tests: three corpora named as the demo's domains (``code``,
``docstrings``, ``docs``), each of its own random tokens so that a sample read from the wrong
corpus changes the loss; a file list per stage; the tiny run on them; and ``tiny-cpu.toml`` with
its ``[data]`` table replaced, for the config's own tests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from goodput.config import load_config
from goodput.testing.tiny import TINY_MODEL, tiny_run_config, write_random_corpus
from goodput.train.config.run import DataConfig, RunConfig, StageConfig

DOMAINS = ("code", "docstrings", "docs")
# Each stage's weights over the domains: a broad mix, more code, an anneal without code.
STAGE_WEIGHTS = (
    {"code": 0.5, "docstrings": 0.3, "docs": 0.2},
    {"code": 0.8, "docs": 0.2},
    {"docstrings": 0.5, "docs": 0.5},
)
TINY_CPU = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"


def write_domain_shards(shards: Path, vocab_size: int, num_docs: int = 120) -> None:
    """A shard set ``shards/<domain>_00000`` per domain of ``num_docs`` documents, as the demo
    names its own."""
    for seed, domain in enumerate(DOMAINS):
        folder = shards / f".{domain}"
        write_random_corpus(
            folder, vocab_size=vocab_size, num_docs=num_docs, lengths=(8, 60), seed=seed
        )
        for suffix in (".bin", ".idx"):
            (folder / f"random{suffix}").rename(shards / f"{domain}_00000{suffix}")


def write_stage_lists(directory: Path, shards: Path) -> list[Path]:
    """A file list per stage of ``STAGE_WEIGHTS`` naming ``shards``' domains; their paths."""
    paths = []
    for index, weights in enumerate(STAGE_WEIGHTS):
        path = directory / f"stage{index}.txt"
        path.write_text("".join(f"{w} {shards / f'{d}_00000'} {d}\n" for d, w in weights.items()))
        paths.append(path)
    return paths


def staged_run_config(directory: Path, starts: tuple[int, ...] = (0, 4, 8)) -> RunConfig:
    """``tiny_run_config`` for 12 steps over the first ``len(starts)`` stages, each starting
    after its step of ``starts``; its data under ``directory/data``."""
    cfg = tiny_run_config(directory)
    shards = directory / "data" / "shards"
    shards.mkdir()
    write_domain_shards(shards, TINY_MODEL.vocab_size)
    lists = write_stage_lists(directory / "data", shards)
    stages = tuple(
        StageConfig(file_list=str(path), start_step=start)
        for path, start in zip(lists, starts, strict=False)
    )
    data = DataConfig(stages=stages, cache=cfg.data.cache)
    return replace(cfg, data=data, train=replace(cfg.train, steps=12))


def load_tiny_cpu(
    folder: Path, data: str, overrides: tuple[str, ...] = (), schedule: str = ""
) -> RunConfig:
    """``tiny-cpu.toml`` with its ``[data]`` table replaced by ``data`` (and its
    ``[schedule]`` by ``schedule`` when given), written into ``folder`` and loaded with
    ``overrides``."""
    text = _replace_table(TINY_CPU.read_text(), "[data]", data)
    if schedule:
        text = _replace_table(text, "[schedule]", schedule)
    path = folder / "run.toml"
    path.write_text(text)
    return load_config(RunConfig, path, overrides)


def _replace_table(text: str, header: str, table: str) -> str:
    start = text.index(header)
    end = text.index("\n[", start + 1)
    return f"{text[:start]}{table}\n{text[end:]}"
