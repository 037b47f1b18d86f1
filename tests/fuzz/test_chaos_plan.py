"""Fuzz the fault plan (``GOODPUT_FAULTS``, ``goodput.faults.load_plan``): any file gives
a plan or one usage-error line naming the variable and the file, never another exception; a
valid plan with any key set to any JSON value is read or refused the same way; and every plan
within the contract reads back exactly, each fault indexed on its own rank only."""

import json

from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.faults import KINDS, MAX_FAULTS, MAX_RANK, MAX_STEP, load_plan
from goodput.testing import fuzz

VALID = {"fired_dir": "/tmp/fired", "faults": [{"id": 0, "kind": "kill", "step": 3, "rank": 1}]}
# Where a value may be changed: a path of keys into VALID.
KEYS = [
    ("fired_dir",),
    ("faults",),
    *(("faults", 0, key) for key in ("id", "kind", "step", "rank")),
]


def read(tmp_path_factory, data: bytes):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_bytes(data)
    try:
        return load_plan({"GOODPUT_FAULTS": str(path)})
    except GoodputError as error:
        assert "\n" not in error.render() and error.code == 2
        assert error.where == f"GOODPUT_FAULTS={str(path)!r}"
        return None


def test_the_valid_plan_reads(tmp_path_factory):
    plan = read(tmp_path_factory, json.dumps(VALID).encode())
    assert plan is not None and [(f.id, f.kind, f.step, f.rank) for f in plan.faults] == [
        (0, "kill", 3, 1)
    ]


@given(data=st.binary(max_size=400))
def test_random_bytes(tmp_path_factory, data):
    read(tmp_path_factory, data)


@given(value=fuzz.json_values(*KINDS, -1, 0, 2**31, MAX_STEP + 1, "/abs", "rel"))
def test_any_json_value(tmp_path_factory, value):
    read(tmp_path_factory, json.dumps(value).encode())


@given(
    key=st.sampled_from(KEYS),
    value=fuzz.json_values(*KINDS, -1, 0, MAX_RANK + 1, "/abs"),
)
def test_a_valid_plan_with_one_value_changed(tmp_path_factory, key, value):
    plan = json.loads(json.dumps(VALID))
    *parents, last = key
    target = plan
    for parent in parents:
        target = target[parent]
    target[last] = value
    read(tmp_path_factory, json.dumps(plan).encode())


faults_strategy = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(min_value=1, max_value=MAX_STEP),
        st.integers(min_value=0, max_value=MAX_RANK),
    ),
    max_size=20,
)


@given(faults=faults_strategy, first_id=st.integers(min_value=0, max_value=1000))
def test_every_plan_within_the_contract_reads_back(tmp_path_factory, faults, first_id):
    entries = [
        {"id": first_id + i, "kind": kind, "step": step, "rank": rank}
        for i, (kind, step, rank) in enumerate(faults)
    ]
    plan = read(tmp_path_factory, json.dumps({"fired_dir": "/tmp/f", "faults": entries}).encode())
    assert plan is not None
    assert [(f.id, f.kind, f.step, f.rank) for f in plan.faults] == [
        (e["id"], e["kind"], e["step"], e["rank"]) for e in entries
    ]
    for fault in plan.faults:  # found where the hooks look, and only there
        if fault.kind in ("ckpt-kill", "save-fail"):
            assert fault in plan.in_save[fault.rank]
        else:
            assert fault in plan.by_step[(fault.step, fault.rank)]


def test_limits_of_size_count_and_repeated_ids(tmp_path_factory):
    one = {"id": 0, "kind": "nan", "step": 1, "rank": 0}
    too_many = {"fired_dir": "/f", "faults": [{**one, "id": i} for i in range(MAX_FAULTS + 1)]}
    assert read(tmp_path_factory, json.dumps(too_many).encode()) is None
    assert read(tmp_path_factory, b" " * (1 << 20) + b"{}") is None  # over 1 MiB
    twice = {"fired_dir": "/f", "faults": [one, one]}
    assert read(tmp_path_factory, json.dumps(twice).encode()) is None
    assert read(tmp_path_factory, b'{"fired_dir": "/f", "faults": [], "faults": []}') is None
    deep = b"[" * 100_000 + b"]" * 100_000
    assert read(tmp_path_factory, deep) is None
    assert read(tmp_path_factory, b'{"fired_dir": "/f", "faults": [{"id": NaN}]}') is None
    true_id = {"fired_dir": "/f", "faults": [{**one, "id": True}]}
    assert read(tmp_path_factory, json.dumps(true_id).encode()) is None
