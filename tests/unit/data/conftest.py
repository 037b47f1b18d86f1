from pathlib import Path

import numpy as np
import pytest

from goodput.data.shards import ShardWriter


def make_shard(
    prefix: Path, num_docs: int, seed: int, max_len: int = 200, vocab: int = 1000
) -> list[np.ndarray]:
    """A shard of random documents, each ending in EOD (id 0)."""
    rng = np.random.default_rng(seed)
    docs = [
        np.append(rng.integers(1, vocab, size=rng.integers(1, max_len)), 0) for _ in range(num_docs)
    ]
    writer = ShardWriter(prefix, np.dtype(np.uint16))
    writer.add_documents(np.concatenate(docs).astype(np.uint16), np.array([len(d) for d in docs]))
    writer.finish()
    return docs


@pytest.fixture
def three_corpora(tmp_path):
    """Three corpora (one of two files) and a file list naming them by relative prefix."""
    data = tmp_path / "data"
    data.mkdir()
    docs = {
        "web_a": make_shard(data / "web_a", 300, 1),
        "web_b": make_shard(data / "web_b", 200, 2),
        "code": make_shard(data / "code", 400, 3),
        "math": make_shard(data / "math", 50, 4),
    }
    file_list = data / "list.txt"
    file_list.write_text(
        "# weight prefix corpus\n\n0.3 web_a web\n0.2 web_b.bin web\n"
        "0.3 code code  # trailing comment\n0.2 math math\n"
    )
    return file_list, docs


@pytest.fixture
def shard_maker():
    """``make_shard``, for a test that needs a shard of its own."""
    return make_shard
