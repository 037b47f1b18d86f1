"""Fuzz the reader of ``RUN/run-id`` (``rundir.run_id``): any bytes give the id they hold, 16
lowercase hex digits and at most a newline, or a GoodputError naming the file; never another
exception, and never an id it did not read."""

import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput import rundir
from goodput.errors import GoodputError

HEX = "0123456789abcdef"
ids = st.text(HEX, min_size=16, max_size=16)
near_ids = st.one_of(
    ids.map(str.encode),
    ids.map(lambda i: (i + "\n").encode()),
    ids.map(lambda i: i.upper().encode()),
    st.binary(max_size=80),
    st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


@given(data=near_ids)
def test_any_run_id_file_is_its_id_or_one_error(data):
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / rundir.RUN_ID).write_bytes(data)
        try:
            found = rundir.run_id(folder, fresh=False)
        except GoodputError as error:
            assert rundir.RUN_ID in str(error.where)
            return
        assert found.encode() in (data, data.removesuffix(b"\n"))
        assert rundir.RUN_ID_TEXT.fullmatch(found)
