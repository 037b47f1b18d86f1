"""The rank's side of in-process recovery (``goodput.train.recovery``): what wakes a collective
that waits on a live peer (real gloo ranks), and the strict reading of what the launcher's store
and environment hand a rank (hostile values, fuzzed). The whole recovery, with real ranks killed,
is tests/chaos/test_chaos_in_process.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.ranks import MAX_SPARES, parse_spare_id, parse_store_address
from goodput.testing.dist import run_distributed
from goodput.testing.fuzz import result_or_refusal
from goodput.train.recovery import abort_groups, int_field, parse_value

ABORT_AT_S = 0.5  # torch's own abort, from another thread
SOCKETS_AT_S = 2.0  # goodput's: the sockets shut down
LATE_PEER_S = 4.0  # the live peer the others wait on enters the collective this late


def _waiting_on_a_live_peer(rank: int, world_size: int) -> tuple[float, str, bool]:
    """Ranks 0 and 1 all-reduce while rank 2 is still busy: rank 0 tries torch's abort first,
    then shuts its sockets down. Returns (seconds until the collective raised, the error's
    type, whether it was still waiting after torch's abort)."""
    start = time.monotonic()
    waiting_after_abort = [False]
    if rank == 0:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))

        def torch_abort() -> None:
            time.sleep(ABORT_AT_S)
            backend.abort()
            time.sleep(SOCKETS_AT_S - ABORT_AT_S - 0.2)
            waiting_after_abort[0] = not done.is_set()
            time.sleep(0.2)
            abort_groups(frozenset())

        threading.Thread(target=torch_abort, daemon=True).start()
    if rank == 2:
        time.sleep(LATE_PEER_S)
    done = threading.Event()
    try:
        dist.all_reduce(torch.ones(4))
        kind = "returned"
    except Exception as error:  # noqa: BLE001 - its type is the result
        kind = type(error).__name__
    done.set()
    return time.monotonic() - start, kind, waiting_after_abort[0]


@pytest.mark.timeout(120)
def test_shut_sockets_wake_a_collective_that_torchs_gloo_abort_leaves_waiting():
    """Measured on torch 2.13: gloo's abort() leaves the all-reduce waiting (for the group's
    60 s timeout here); shutting the process's sockets down makes it raise at once, and the
    error reaches the rank waiting on this one."""
    results = run_distributed(_waiting_on_a_live_peer, 3, timeout_s=100)
    (waited_0, kind_0, waiting_after_abort), (waited_1, kind_1, _), (_, kind_2, _) = results
    assert waiting_after_abort, "torch's gloo abort() woke the collective: drop the sockets"
    assert kind_0 != "returned" and kind_1 != "returned" and kind_2 != "returned", results
    assert SOCKETS_AT_S - 0.1 < waited_0 < SOCKETS_AT_S + 5, results
    assert waited_1 < SOCKETS_AT_S + 5, results  # woken by rank 0's closed sockets, not at 60 s


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"x" * 5000, "5000 bytes, more than 4096"),
        (b"\xff\xfe", "not JSON"),
        (b"{bad", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"7", "not a JSON object"),
    ],
)
def test_a_broken_store_value_is_one_line_naming_the_key(raw, why):
    with pytest.raises(GoodputError) as caught:
        parse_value("spare/0", raw)
    assert "key spare/0" in str(caught.value) and why in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("value", [{"rank": "1"}, {"rank": 1.0}, {"rank": True}, {"rank": -1},
                                   {"rank": 4}, {}, {"rank": None}])  # fmt: skip
def test_a_field_out_of_range_or_of_another_type_is_refused(value):
    with pytest.raises(GoodputError, match="rank .* is not an integer in \\[0, 3\\]"):
        int_field("spare/0", value, "rank", 0, 3)


@given(st.binary(max_size=300))
def test_any_store_value_parses_or_is_refused(raw):
    value = result_or_refusal(parse_value, "next/0", raw)
    assert value is None or isinstance(value, dict)


@pytest.mark.parametrize(
    "text",
    ["", "host", ":80", "host:", "host:0", "host:65536", "host:80x", "a b:80", "-h:80",
     "host:99999999999", "h" * 300 + ":80", "host:-1"],
)  # fmt: skip
def test_a_bad_store_address_is_refused(text):
    with pytest.raises(GoodputError, match="GOODPUT_RECOVERY_STORE"):
        parse_store_address(text)


def test_a_store_address_parses():
    assert parse_store_address("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_store_address("node-7.cluster:1") == ("node-7.cluster", 1)


@pytest.mark.parametrize("text", ["", "-1", "x", "1.5", str(MAX_SPARES), "1" * 20, " 1"])
def test_a_bad_spare_number_is_refused(text):
    with pytest.raises(GoodputError, match="GOODPUT_SPARE"):
        parse_spare_id(text)


@given(st.text(max_size=40))
def test_any_environment_value_parses_or_is_refused(text):
    address = result_or_refusal(parse_store_address, text)
    assert address is None or 1 <= address[1] <= 65535
    spare = result_or_refusal(parse_spare_id, text)
    assert spare is None or 0 <= spare < MAX_SPARES
