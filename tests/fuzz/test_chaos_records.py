"""Fuzz the fault hooks' fired records as a chaos campaign reads them back (``chaos.records``; the
runs themselves are read by ``report.run_files``, fuzzed in ``test_report_files.py``).

Properties: any folder gives records or one ``GoodputError`` naming the file, never another
exception; a valid record with any key set to any JSON value is read or refused the same way,
and what the hooks write reads back as written.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from goodput.chaos import records
from goodput.faults import KINDS
from goodput.testing.fuzz import json_values, result_or_refusal

FIRED = {"id": 2, "kind": "kill", "step": 3, "rank": 1, "time": 1.7e9}


@given(
    st.dictionaries(
        st.one_of(st.text(max_size=12), st.sampled_from(["0.json", "2.json", ".2.json.x.tmp"])),
        st.one_of(st.binary(max_size=200), json_values(*FIRED.values()).map(json.dumps)),
        max_size=4,
    )
)
def test_any_fired_folder_reads_as_records_or_one_line(files):
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        for name, content in files.items():
            if not name or "/" in name or "\0" in name or name in (".", ".."):
                continue
            try:
                path = directory / name
                path.write_bytes(content if isinstance(content, bytes) else content.encode())
            except OSError:  # a name this filesystem refuses
                continue
        found = result_or_refusal(records.read_fired, directory)
        assert found is None or all(record.kind in KINDS for record in found)


@given(st.sampled_from(sorted(FIRED)), json_values())
def test_a_fired_record_with_any_value_anywhere_is_read_or_refused(key, value):
    with tempfile.TemporaryDirectory() as folder:
        record = {**FIRED, key: value}
        Path(folder, "2.json").write_text(json.dumps(record))
        found = result_or_refusal(records.read_fired, Path(folder))
        assert found is None or found == [records.FiredRecord(**record)]
