"""Fuzz the fault plan (``GOODPUT_FAULTS``, ``goodput.faults.load_plan``): any file gives
a plan or one usage-error line naming the variable and the file, never another exception; a
valid plan with any key set to any JSON value is read or refused the same way; every plan
within the contract reads back exactly, each fault indexed on its own rank only; and a fault
given a key of another kind, or lacking one of its own, is refused naming that key."""

import json

from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.faults import KIND_KEYS, KINDS, MAX_FAULTS, MAX_RANK, MAX_STEP, load_plan
from goodput.testing import fuzz

VALID = {
    "fired_dir": "/tmp/fired",
    "faults": [
        {"id": 0, "kind": "kill", "step": 3, "rank": 1},
        {"id": 1, "kind": "slow", "step": 4, "rank": 0, "seconds": 0.5, "steps": 7},
        {"id": 2, "kind": "stall", "step": 12, "rank": 1, "where": "collective"},
    ],
}
# Where a value may be changed: a path of keys into VALID.
KEYS = [
    ("fired_dir",),
    ("faults",),
    *(("faults", i, key) for i, entry in enumerate(VALID["faults"]) for key in entry),
]
OWN_KEYS = sorted(set().union(*KIND_KEYS.values()))


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
    assert plan is not None and [f.keys() for f in plan.faults] == VALID["faults"]


@given(data=st.binary(max_size=400))
def test_random_bytes(tmp_path_factory, data):
    read(tmp_path_factory, data)


@given(value=fuzz.json_values(*KINDS, -1, 0, 2**31, MAX_STEP + 1, "/abs", "rel", "data", 600.5))
def test_any_json_value(tmp_path_factory, value):
    read(tmp_path_factory, json.dumps(value).encode())


@given(
    key=st.sampled_from(KEYS),
    value=fuzz.json_values(*KINDS, -1, 0, MAX_RANK + 1, "/abs", "data", 1e-300, 600, 600.001),
)
def test_a_valid_plan_with_one_value_changed(tmp_path_factory, key, value):
    plan = json.loads(json.dumps(VALID))
    *parents, last = key
    target = plan
    for parent in parents:
        target = target[parent]
    target[last] = value
    read(tmp_path_factory, json.dumps(plan).encode())


# The keys of its own each kind takes, within the contract.
own_values = {
    "seconds": st.floats(min_value=0, max_value=600, exclude_min=True) | st.integers(1, 600),
    "steps": st.integers(min_value=1, max_value=MAX_STEP),
    "where": st.sampled_from(["data", "collective"]),
}
faults_strategy = st.lists(
    st.sampled_from(KINDS).flatmap(
        lambda kind: st.fixed_dictionaries(
            {
                "kind": st.just(kind),
                "step": st.integers(min_value=1, max_value=MAX_STEP),
                "rank": st.integers(min_value=0, max_value=MAX_RANK),
                **{key: own_values[key] for key in KIND_KEYS.get(kind, ())},
            }
        )
    ),
    max_size=20,
)


@given(faults=faults_strategy, first_id=st.integers(min_value=0, max_value=1000))
def test_every_plan_within_the_contract_reads_back(tmp_path_factory, faults, first_id):
    entries = [{"id": first_id + i, **fault} for i, fault in enumerate(faults)]
    plan = read(tmp_path_factory, json.dumps({"fired_dir": "/tmp/f", "faults": entries}).encode())
    assert plan is not None
    assert [f.keys() for f in plan.faults] == entries
    for fault in plan.faults:  # found where the hooks look, and only there
        if fault.kind in ("ckpt-kill", "save-fail"):
            assert fault in plan.in_save[fault.rank]
        elif fault.kind == "snapshot-kill":
            assert fault in plan.in_snapshot[fault.rank]
        elif fault.kind == "slow":
            assert fault in plan.slow[fault.rank] and fault.in_window(fault.step)
            assert not fault.in_window(fault.step + fault.steps)
        else:
            assert fault in plan.by_step[(fault.step, fault.rank)]


@given(kind=st.sampled_from(KINDS), key=st.sampled_from(OWN_KEYS), drop=st.booleans())
def test_a_key_foreign_to_the_kind_or_missing_is_refused_naming_it(
    tmp_path_factory, kind, key, drop
):
    own = {"seconds": 1.5, "steps": 3, "where": "data"}
    entry = {"id": 0, "kind": kind, "step": 1, "rank": 0}
    entry |= {name: own[name] for name in KIND_KEYS.get(kind, ())}
    if key in entry and drop:
        del entry[key]
        said = f"faults[0] (kind {kind}) lacks the key {key!r}"
    elif key not in entry:
        entry[key] = own[key]
        said = f"faults[0] (kind {kind}) has the unknown key {key!r}"
    else:
        return  # the entry stays valid
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps({"fired_dir": "/f", "faults": [entry]}))
    try:
        load_plan({"GOODPUT_FAULTS": str(path)})
    except GoodputError as error:
        assert said in error.what, error.what
    else:
        raise AssertionError(f"{entry} was taken")


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
