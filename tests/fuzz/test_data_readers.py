"""Fuzz the raw-input readers: random bytes and random JSON lines as ``.jsonl``, ``.jsonl.gz``,
``.jsonl.zst`` and ``.txt`` give documents (strings) or one GoodputError naming the file."""

import gzip
import json

import zstandard
from hypothesis import given
from hypothesis import strategies as st

from goodput.data.readers import iter_texts
from goodput.errors import GoodputError
from goodput.testing import fuzz

json_values = fuzz.json_values()
records = json_values | st.fixed_dictionaries({"text": json_values})


def read_or_refuse(path):
    try:
        texts = list(iter_texts(path))
    except GoodputError as error:
        assert "\n" not in error.render() and error.render().startswith(str(path))
        return
    assert all(isinstance(text, str) and text.strip() for text in texts)


COMPRESS = {".jsonl": bytes, ".jsonl.gz": gzip.compress, ".jsonl.zst": zstandard.compress}


@given(data=st.binary(max_size=300), suffix=st.sampled_from([*COMPRESS, ".txt"]))
def test_random_bytes(tmp_path, data, suffix):
    path = tmp_path / f"a{suffix}"
    path.write_bytes(data)
    read_or_refuse(path)


@given(
    lines=st.lists(records.map(json.dumps) | st.text(max_size=20), max_size=8),
    suffix=st.sampled_from(list(COMPRESS)),
    cut=st.integers(0, 40),
)
def test_json_lines(tmp_path, lines, suffix, cut):
    data = COMPRESS[suffix]("\n".join(lines).encode("utf-8", "surrogatepass"))
    path = tmp_path / f"a{suffix}"
    path.write_bytes(data[: len(data) - cut] if suffix != ".jsonl" else data)
    read_or_refuse(path)
