"""Manifests from disk are checked field by field: a damaged or hostile one is one line."""

import json

import pytest

from goodput.data.blend import BlendSpec, BlendStage, build_blend
from goodput.data.inspect import describe
from goodput.data.loader import DataLoader
from goodput.data.manifest import read_dataset_manifest, read_run_manifest, verify_dataset
from goodput.errors import GoodputError

SHA = "ab" * 32


def dataset(**overrides):
    shard = {"shard": "web_00000", "sha256_bin": SHA, "sha256_idx": SHA, "num_tokens": 3}
    tokenizer = {
        "kind": "sentencepiece",
        "path": "/t.model",
        "sha256": SHA,
        "library": "sentencepiece==0.2.0",
        "vocab_size": 300,
        "eod_id": 2,
    }
    manifest = {
        "format": "goodput.shards/1",
        "job_key": "k",
        "tokenizer": tokenizer,
        "pack_seq_len": None,
        "num_documents": 1,
        "num_tokens": 3,
        "num_empty_skipped": 0,
        "shards": [shard],
    }
    for key, value in overrides.items():
        if key.startswith("shard."):
            shard[key.removeprefix("shard.")] = value
        else:
            manifest[key] = value
    return manifest


def error_of(function, path):
    with pytest.raises(GoodputError) as exc:
        function(path)
    message = exc.value.render()
    assert "\n" not in message
    return message


def test_a_well_formed_manifest_reads(tmp_path):
    path = tmp_path / "web.manifest.json"
    path.write_text(json.dumps(dataset()))
    assert read_dataset_manifest(path)["shards"][0]["shard"] == "web_00000"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"shard.shard": "../../etc/passwd"}, "field shards[0].shard must be a plain file name"),
        ({"shard.shard": "/abs"}, "must be a plain file name"),
        ({"shard.sha256_bin": "../x"}, "field shards[0].sha256_bin must be a sha256 hex digest"),
        ({"shard.num_tokens": -1}, "must be a whole number >= 0, got -1"),
        ({"shard.num_tokens": True}, "must be a whole number >= 0, got True"),
        ({"shards": {}}, "field shards must be an array"),
        ({"format": "goodput.shards/9"}, "field format must be one of 'goodput.shards/1'"),
        ({"pack_seq_len": 0}, "field pack_seq_len must be a whole number >= 1, got 0"),
        ({"tokenizer": None}, "field tokenizer must be an object, got None"),
    ],
)
def test_bad_fields_are_named(tmp_path, overrides, message):
    path = tmp_path / "web.manifest.json"
    path.write_text(json.dumps(dataset(**overrides)))
    assert error_of(read_dataset_manifest, path).startswith(f"{path}: ")
    assert message in error_of(read_dataset_manifest, path)
    assert message in error_of(verify_dataset, path)
    assert message in error_of(describe, path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "field (the whole file) must be an object"),
        ("{", "is not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("{}", "field format is missing"),
    ],
)
def test_garbage_files_are_one_line(tmp_path, text, message):
    path = tmp_path / "web.manifest.json"
    path.write_text(text)
    assert message in error_of(read_dataset_manifest, path)


def test_a_hostile_run_manifest_is_refused(three_corpora, tmp_path):
    file_list, _ = three_corpora
    spec = BlendSpec(
        stages=(BlendStage(file_list, 0),), seq_len=32, num_samples=64, seed=1, cache=tmp_path
    )
    directory, _ = build_blend(spec)
    path = directory / "blend.json"
    good = json.loads(path.read_text())
    for edit, message in [
        (lambda m: m["shards"][0].update(sha256_bin="../../x"), "shards[0].sha256_bin must be"),
        (lambda m: m["weights"][0].__setitem__(1, float("nan")), "weights[0] must be a pair"),
        (lambda m: m.update(seq_len=0), "field seq_len must be a whole number >= 1"),
        (lambda m: m["report"]["corpora"].pop(), "the report's corpora are not the weights'"),
        (lambda m: m["shards"][0].update(corpus="other"), "shards[0] is of corpus 'other'"),
        (lambda m: m["shards"][0].update(num_samples=9999), "shards[0].num_samples does not"),
        (lambda m: m["report"]["corpora"][0].update(samples=1), "do not add up to num_samples"),
    ]:
        manifest = json.loads(json.dumps(good))
        edit(manifest)
        path.write_text(json.dumps(manifest))
        assert message in error_of(read_run_manifest, path)
    flipped = json.loads(json.dumps(good))  # "packed" is not fingerprinted: the checksums know
    flipped["shards"][0]["packed"] = True
    flipped["shards"][0]["num_samples"] = flipped["shards"][0]["num_documents"]
    flipped["report"]["corpora"][0]["available"] += (
        flipped["shards"][0]["num_samples"] - good["shards"][0]["num_samples"]
    )
    path.write_text(json.dumps(flipped))
    with pytest.raises(GoodputError, match="does not list exactly the index arrays"):
        DataLoader(directory, global_batch_size=8, dp_rank=0, dp_size=1)
    path.write_text(json.dumps(good))
    loader = DataLoader(directory, global_batch_size=8, dp_rank=0, dp_size=1)
    for state in ({}, {"consumed_samples": "8", "fingerprint": "x", "components": {}}):
        with pytest.raises(GoodputError, match="checkpoint data state: field "):
            loader.load_state_dict(state)
