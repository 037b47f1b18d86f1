"""Fuzz the blend file-list parser with random text and random bytes: entries whose weights give
every corpus a usable share, or a GoodputError naming the file."""

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from goodput.data.file_list import corpus_weights, parse_file_list
from goodput.data.shards import ShardWriter
from goodput.errors import GoodputError

NUMBERS = ["1", "0", "-1", "nan", "inf", "1e400", "1e-320", "1e308", "0.5", "1_0", "x", ""]
PREFIXES = ["a", "a.bin", "b.idx", "./a", "../d/a", "/nonexistent/a", "b", "d"]


def parse_or_refuse(path):
    try:
        entries = parse_file_list(path)
        shares = corpus_weights(entries, path)
    except GoodputError as error:
        assert "\n" not in error.render() and error.render().startswith(str(path))
        return
    assert all(0 < share <= 1 and math.isfinite(share) for _, share in shares)


def shards(folder):
    for name in ("a", "b"):
        writer = ShardWriter(folder / name, np.dtype(np.uint16))
        writer.add_documents(np.array([1, 2, 0], np.uint16), np.array([3]))
        writer.finish()
    (folder / "d").mkdir(exist_ok=True)


lines = st.lists(
    st.tuples(st.sampled_from(NUMBERS) | st.text(max_size=6), st.sampled_from(PREFIXES)).map(
        lambda t: f"{t[0]} {t[1]} c{len(t[1]) % 3}"
    )
    | st.text(max_size=30),
    max_size=6,
)


@given(lines=lines)
def test_lines(tmp_path, lines):
    shards(tmp_path)
    path = tmp_path / "list.txt"
    path.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    parse_or_refuse(path)


@given(data=st.binary(max_size=200))
def test_random_bytes(tmp_path, data):
    shards(tmp_path)
    path = tmp_path / "list.txt"
    path.write_bytes(data)
    parse_or_refuse(path)
