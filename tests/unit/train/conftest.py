from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from goodput.data.shards import ShardWriter
from goodput.testing.tiny import TINY_MODEL
from goodput.train.config import DataConfig, RunConfig, TrainConfig
from goodput.train.parallelize import ParallelConfig
from goodput.train.schedule import ScheduleConfig


def write_counting_corpus(prefix: Path, num_docs: int = 200, vocab: int = 61) -> None:
    """Documents that count upward mod (vocab - 1) by a per-document stride: learnable in a few
    steps, so a falling loss shows the loop trains. Token 0 is the EOD."""
    rng = np.random.default_rng(0)
    docs = []
    for _ in range(num_docs):
        start, stride, length = rng.integers(0, vocab - 1), rng.integers(1, 4), rng.integers(8, 80)
        docs.append(np.append(1 + (start + stride * np.arange(length)) % (vocab - 1), 0))
    writer = ShardWriter(prefix, np.dtype(np.uint16))
    writer.add_documents(np.concatenate(docs).astype(np.uint16), np.array([len(d) for d in docs]))
    writer.finish()


@pytest.fixture
def run_config(tmp_path) -> RunConfig:
    """A complete tiny run: 8 steps of 8 samples x 16 tokens, fp32 so ranks compare exactly."""
    data = tmp_path / "data"
    data.mkdir()
    write_counting_corpus(data / "counting")
    (data / "list.txt").write_text("1.0 counting counting\n")
    return RunConfig(
        model=replace(TINY_MODEL, max_seq_len=64),
        train=TrainConfig(
            steps=8,
            tokens_per_step=128,
            seq_len=16,
            micro_batch_size=2,
            output=str(tmp_path / "run"),
            peak_tflops=1.0,
        ),
        data=DataConfig(file_list=str(data / "list.txt"), cache=str(tmp_path / "cache")),
        schedule=ScheduleConfig(lr=1e-2, warmup_steps=2),
        parallel=ParallelConfig(precision="fp32"),
    )
