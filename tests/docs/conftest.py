"""The demo's data, shared by the docs pages' runs that read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from goodput.demo import build_shards


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """The demo's data up to the shards (corpus, tokenizer, shards, file list), built once as the
    demo builds it (``goodput.demo.build_shards``: the same bytes every time, and tens of seconds
    on 2 cores a build). Read only: a test copies the folder where its commands expect it, as
    they write their runs and blend caches under it (the copied manifests still name the inputs
    and tokenizer they were made from here, as a moved folder's would)."""
    return build_shards(tmp_path_factory.mktemp("demo-data") / "demo").parent
