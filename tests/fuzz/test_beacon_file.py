"""Fuzz the beacon reader (``goodput.beacon.read_beacon``): the launcher reads every rank's
beacon during a hang, and any of them may be hostile.

Property: random bytes of any size, a real beacon with bytes flipped or cut, a symlink, a
folder or a FIFO in its place: a ``BeaconState`` whose fields are in range, or a
``GoodputError`` naming the file, never another exception and never a hang.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from goodput.beacon import (
    PHASES,
    SITES,
    SIZE,
    BeaconState,
    beacon_path,
    open_beacon,
    read_beacon,
)
from goodput.errors import GoodputError
from goodput.ranks import BEACON_DIR_VAR


@functools.cache
def _valid_image() -> bytes:
    with tempfile.TemporaryDirectory() as directory:
        beacon = open_beacon(
            {BEACON_DIR_VAR: directory}, rank=2, world_size=4, local_rank=0, host="nid9"
        )
        assert beacon is not None
        try:
            with beacon.collective("step.sums"):
                beacon.step(12)
            return beacon_path(directory, 2).read_bytes()
        finally:
            beacon.close()


def _check(path: Path) -> None:
    try:
        state = read_beacon(path)
    except GoodputError as error:
        assert str(path) in str(error)
        return
    assert isinstance(state, BeaconState)
    assert 0 <= state.rank < state.world_size and state.pid > 0
    assert state.phase in PHASES and state.last_site in ("", *SITES)
    assert state.host.isprintable() and len(state.host.encode()) <= 64


def _written(directory: Path, data: bytes) -> Path:
    path = directory / "rank-00002.beacon"
    path.write_bytes(data)
    return path


@given(data=st.binary(max_size=2 * SIZE))
def test_random_bytes(data):
    with tempfile.TemporaryDirectory() as directory:
        _check(_written(Path(directory), data))


@given(
    flips=st.lists(
        st.tuples(st.integers(0, SIZE - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    cut=st.one_of(st.none(), st.integers(0, SIZE + 64)),
)
def test_a_real_beacon_damaged(flips, cut):
    image = bytearray(_valid_image())
    for offset, value in flips:
        image[offset] = value
    data = bytes(image) if cut is None else bytes(image[:cut]) + b"\0" * max(0, cut - SIZE)
    with tempfile.TemporaryDirectory() as directory:
        _check(_written(Path(directory), data))


def test_the_valid_image_reads():
    with tempfile.TemporaryDirectory() as directory:
        state = read_beacon(_written(Path(directory), _valid_image()))
    assert (state.rank, state.step, state.last_site, state.torn) == (2, 12, "step.sums", False)


@pytest.mark.parametrize("kind", ["symlink", "folder", "fifo", "missing"])
def test_not_a_file(tmp_path, kind):
    path = tmp_path / "rank-00002.beacon"
    if kind == "symlink":
        (tmp_path / "real").write_bytes(_valid_image())
        path.symlink_to(tmp_path / "real")  # a valid beacon, behind a link: refused
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # opened without blocking, refused as not a regular file
    with pytest.raises(GoodputError, match="not a goodput beacon") as error:
        read_beacon(path)
    assert str(path) in str(error.value)
