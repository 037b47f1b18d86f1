"""Fuzz the vendor tool parsers of ``python -m goodput.launch.health --device``.

Property: any text a tool prints — random text, lines shaped like the real output with hostile
fields, deep or huge JSON — gives a result or a one-line ``Refusal``, never another exception
and never a hang.
"""

from __future__ import annotations

import json
import time

from hypothesis import given
from hypothesis import strategies as st

from goodput.launch import device_tools

MAX_SECONDS = 2.0
PARSERS = [
    device_tools.parse_nvidia_list,
    device_tools.parse_nvidia_ecc,
    device_tools.parse_nvidia_remap,
    device_tools.parse_xid,
    device_tools.parse_amd_ecc,
    device_tools.parse_rocm_ids,
    device_tools.parse_xpu_discovery,
    device_tools.parse_xpu_health,
    lambda text: device_tools.parse_xpu_stats(text, 0),
]

fields = st.one_of(
    st.sampled_from(["0", "3", "Yes", "No", "[N/A]", "-1", "1e9", "", "x" * 300, "\x00"]),
    st.text(max_size=12),
)
csv_lines = st.lists(fields, min_size=1, max_size=5).map(", ".join)
tool_lines = st.one_of(
    csv_lines,
    st.builds("GPU {}: NVIDIA A100 (UUID: GPU-{})".format, fields, fields),
    st.builds("NVRM: Xid (PCI:{}): {}, pid=1".format, fields, fields),
    st.sampled_from(["No devices were found", "  MIG 1g.10gb Device 0: (UUID: MIG-1)"]),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), fields),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(
                ["device_list", "device_id", "status", "metrics_type", "value", "card0", "gpu"]
                + ["total_uncorrectable_count", "ecc", "memory"]
            ),
            inner,
            max_size=4,
        ),
    ),
    max_leaves=20,
)
texts = st.one_of(
    st.text(max_size=400),
    st.lists(tool_lines, max_size=8).map("\n".join),
    json_values.map(json.dumps),
    st.integers(1, 200_000).map(lambda depth: "[" * depth + "]" * depth),
    st.just(json.dumps([{"uncorrectable": 1}] * 150_000)),
)


@given(st.sampled_from(PARSERS), texts)
def test_any_text_gives_a_result_or_a_one_line_refusal(parse, text):
    start = time.monotonic()
    try:
        parse(text)
    except device_tools.Refusal as refusal:
        line = str(refusal)
        assert "\n" not in line and 0 < len(line) <= device_tools.MAX_LINE_CHARS
    assert time.monotonic() - start < MAX_SECONDS
