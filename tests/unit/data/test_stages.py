"""Data-mix stages: the ±1 bound per stage, per-corpus cursors across stages, wraps reported,
a one-stage blend being the plain one, the schedule's checks and the shards' consistency."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from goodput.data.blend import BlendSpec, BlendStage, build_blend, build_blend_index, format_report
from goodput.data.loader import BlendedSamples
from goodput.data.manifest import FINGERPRINTED, read_run_manifest
from goodput.data.stages import MAX_STAGES, check_stages, interleave_stages, stage_of_sample
from goodput.errors import GoodputError


def staged_spec(tmp_path: Path, stages, **overrides) -> BlendSpec:
    values = {
        "stages": tuple(BlendStage(path, start) for start, path in stages),
        "seq_len": 32,
        "num_samples": 1024,
        "seed": 5,
        "cache": tmp_path / "cache",
        "report_batch_size": 16,
        "step_samples": 16,
    }
    return BlendSpec(**{**values, **overrides})


@pytest.fixture
def stage_lists(three_corpora, shard_maker):
    """Stage 0: the three corpora; stage 1: code and math only; stage 2: web and a fourth
    corpus, 'small', that wraps."""
    file_list, _ = three_corpora
    data = file_list.parent
    shard_maker(data / "small", 8, 9, max_len=40)
    (data / "stage1.txt").write_text("0.9 code code\n0.1 math math\n")
    (data / "stage2.txt").write_text("0.3 web_b web\n0.2 web_a web\n0.5 small small\n")
    return file_list, data / "stage1.txt", data / "stage2.txt"


def within_one_of_the_mixture(corpora: np.ndarray, weights: np.ndarray) -> None:
    """Every prefix of ``corpora`` holds each corpus within one sample of weight x n."""
    shares = weights / weights.sum()
    counts = np.cumsum(corpora[:, None] == np.arange(len(weights))[None, :], axis=0)
    n = np.arange(1, len(corpora) + 1)[:, None]
    assert np.abs(counts - shares[None, :] * n).max() <= 1 + 1e-9


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(
        st.lists(st.one_of(st.just(0.0), st.floats(0.01, 10.0)), min_size=4, max_size=4),
        min_size=1,
        max_size=5,
    ).filter(lambda rows: all(any(w > 0 for w in row) for row in rows)),
    cuts=st.lists(st.integers(1, 599), max_size=4, unique=True),
)
def test_every_prefix_of_every_stage_keeps_the_mixture_and_cursors_carry_on(weights, cuts):
    starts = [0, *sorted(cuts)][: len(weights)]
    stage_weights = np.array(weights[: len(starts)])
    corpus_index, sample_index = interleave_stages(stage_weights, starts, 600)
    for k, start in enumerate(starts):
        stop = starts[k + 1] if k + 1 < len(starts) else 600
        present = np.flatnonzero(stage_weights[k] > 0)
        local = np.searchsorted(present, corpus_index[start:stop])
        assert np.isin(corpus_index[start:stop], present).all()  # an omitted corpus: none
        within_one_of_the_mixture(local, stage_weights[k][present])
    for corpus in range(4):  # one running count per corpus, across every stage
        numbers = sample_index[corpus_index == corpus]
        assert (numbers == np.arange(len(numbers))).all()
    assert [stage_of_sample(starts, s) for s in starts] == list(range(len(starts)))


def test_each_corpus_keeps_its_cursor_and_a_wrap_is_reported(stage_lists, tmp_path, capfd):
    stage0, stage1, stage2 = stage_lists
    spec = staged_spec(tmp_path, [(0, stage0), (512, stage1), (768, stage2)])
    directory, manifest = build_blend(spec)
    samples = BlendedSamples(directory)
    assert samples.stage_starts == [0, 512, 768]
    assert [samples.stage_of_sample(i) for i in (0, 511, 512, 767, 768, 1023)] == [0, 0, 1, 1, 2, 2]
    assert samples.corpus_names == ["web", "code", "math", "small"]  # first appearance
    stages = manifest["stages"]
    rows = {
        (k, row["name"]): row
        for k, stage in enumerate(stages)
        for row in stage["report"]["corpora"]
    }
    assert [row["name"] for row in stages[2]["report"]["corpora"]] == ["web", "small"]
    assert rows[2, "small"]["wrapped"] and not rows[2, "web"]["wrapped"]
    assert not any(row["wrapped"] for k, row in rows.items() if k[0] < 2)
    assert "corpus 'small' wraps in stage 2" in capfd.readouterr().err
    assert "WARNING: corpus 'small' wraps in stage 2" in format_report(directory, manifest)
    seen: dict[int, set[int]] = {}
    for k, (start, stop) in enumerate([(0, 512), (512, 768), (768, 1024)]):
        identities = np.frombuffer(samples.identities(start, stop)[2 * (stop - start) :], "<i8")
        corpora = np.asarray(samples.corpus_index[start:stop])
        for c, name in enumerate(samples.corpus_names):
            drawn = identities[corpora == c].tolist()
            row = rows.get((k, name))
            assert (row["samples"] if row else 0) == len(drawn)
            if row and row["samples"]:
                assert row["first_sample"] == len(seen.get(c, ()))
            repeated = seen.setdefault(c, set()) & set(drawn) or len(set(drawn)) < len(drawn)
            assert not repeated or (row and row["wrapped"])  # a repeat only once wrapped
            seen[c] |= set(drawn)


def test_one_stage_is_the_plain_blend_and_later_stages_add_components(stage_lists, tmp_path):
    stage0, stage1, _ = stage_lists
    _, plain = build_blend(staged_spec(tmp_path, [(0, stage0)]))
    assert len(plain["stages"]) == 1 and plain["stages"][0]["start_sample"] == 0
    assert set(plain["components"]) == set(FINGERPRINTED)
    directory, staged = build_blend(staged_spec(tmp_path, [(0, stage0), (512, stage1)]))
    assert staged["components"] == {
        **plain["components"],
        "stage 1": staged["components"]["stage 1"],
    }
    plain_samples = BlendedSamples(Path(tmp_path / "cache" / "blends" / plain["fingerprint"][:20]))
    staged_samples = BlendedSamples(directory)
    assert staged_samples.identities(0, 512) == plain_samples.identities(0, 512)
    assert staged_samples.identities(512, 600) != plain_samples.identities(512, 600)
    unstaged = build_blend_index([weight for _, weight in plain["weights"]], 1024)
    assert (np.asarray(plain_samples.corpus_index) == unstaged[0]).all()
    assert (np.asarray(plain_samples.sample_index) == unstaged[1]).all()
    recorded = read_run_manifest(directory / "blend.json")["stages"]
    assert [(s["start_sample"], s["file_list"]) for s in recorded] == [
        (0, str(stage0)),
        (512, str(stage1)),
    ]
    assert recorded[1]["weights"] == [["code", 0.9], ["math", 0.1]]


@pytest.mark.parametrize(
    ("starts", "num_samples", "message"),
    [
        ([5], 100, "stage 0 (file list a.txt): starts at sample 5; start the first stage at"),
        ([0, 32, 32], 100, "stage 2 (file list a.txt): starts at sample 32, not after stage 1"),
        ([0, 96, 64], 100, "stage 2 (file list a.txt): starts at sample 64, not after"),
        ([0, 128], 100, "before the run's end (100)"),
        ([0, 40], 100, "inside a step of 16 samples; start it at sample 32 or 48"),
        ([0] * (MAX_STAGES + 1), 10**6, f"65 stages, not in [1, {MAX_STAGES}]"),
        ([], 100, "0 stages"),
    ],
)
def test_a_schedule_the_blend_cannot_honour_is_refused(
    starts, num_samples, message, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    Path("a.txt").write_text("1 x x\n")  # a file list that exists; what it says is not read
    stages = [BlendStage(Path("a.txt"), start) for start in starts]
    with pytest.raises(GoodputError, match=re.escape(message)) as refused:
        check_stages(stages, num_samples, 16)
    assert refused.value.code == 2


def test_a_corpus_keeps_its_shards_across_stages(stage_lists, tmp_path):
    stage0, stage1, _ = stage_lists
    stage1.write_text("0.9 web_a web\n0.1 math math\n")  # web without web_b
    message = f"{stage1}: corpus 'web' lists other shards than in {stage0}"
    with pytest.raises(GoodputError, match=re.escape(message)):
        build_blend(staged_spec(tmp_path, [(0, stage0), (512, stage1)]))
    stage1.write_text("1 code other\n")  # stage 0's code shard under another name
    with pytest.raises(
        GoodputError, match=r"is the same shard as .* \(corpus 'code'\) on .*list.txt:5"
    ):
        build_blend(staged_spec(tmp_path, [(0, stage0), (512, stage1)]))


def test_an_edited_stage_is_named(stage_lists, tmp_path):
    stage0, stage1, _ = stage_lists
    directory, _ = build_blend(staged_spec(tmp_path, [(0, stage0), (512, stage1)]))
    path = directory / "blend.json"
    text = path.read_text()
    path.write_text(text.replace('"start_sample": 512', '"start_sample": 500'))
    with pytest.raises(GoodputError, match="fingerprint mismatch: stage 1 edited"):
        BlendedSamples(directory)
    path.write_text(text.replace('"start_sample": 512', '"start_sample": 0'))
    with pytest.raises(GoodputError, match="stage starts must increase"):
        BlendedSamples(directory)
    good = json.loads(text)
    for edit, message in [
        (lambda m: m.update(stages="x"), "field stages must be an array"),
        (lambda m: m["stages"][1].update(start_sample=-1), "stages[1].start_sample must be a"),
        (lambda m: m["stages"][1].pop("weights"), "field stages[1].weights is missing"),
        (lambda m: m["stages"][0]["report"]["corpora"][0].update(wrapped="no"), "wrapped must"),
        (lambda m: m["stages"][1]["weights"].append(["nope", 0.5]), "must name corpora of the"),
        (lambda m: m["stages"].extend([m["stages"][1]] * MAX_STAGES), "stages must be 1 to 64"),
    ]:
        manifest = json.loads(text)
        edit(manifest)
        path.write_text(json.dumps(manifest))
        with pytest.raises(GoodputError, match=re.escape(message)) as refused:
            read_run_manifest(path)
        assert str(path) in str(refused.value)
    path.write_text(json.dumps(good))
    assert BlendedSamples(directory).stage_starts == [0, 512]


def test_on_exhausted_error_names_the_stage_that_wraps(stage_lists, tmp_path):
    stage0, stage1, stage2 = stage_lists
    spec = staged_spec(tmp_path, [(0, stage0), (512, stage1), (768, stage2)], on_exhausted="error")
    with pytest.raises(
        GoodputError, match=rf"{stage2}: corpus 'small' needs \d+ samples but holds"
    ):
        build_blend(spec)


def test_a_cache_hit_reports_each_stage_at_the_batch_size_asked(stage_lists, tmp_path, capfd):
    stage0, stage1, _ = stage_lists
    stages = [(0, stage0), (512, stage1)]
    directory, built = build_blend(staged_spec(tmp_path, stages))
    again, cached = build_blend(staged_spec(tmp_path, stages, report_batch_size=256))
    assert again == directory and "blend: cached at" in capfd.readouterr().err
    assert [stage["report"]["batch_size"] for stage in cached["stages"]] == [256, 256]
    for fresh, hit in zip(built["stages"], cached["stages"], strict=True):
        assert [row["samples"] for row in fresh["report"]["corpora"]] == [
            row["samples"] for row in hit["report"]["corpora"]
        ]
    # the ±1 bound on every prefix puts every aligned batch within 2 of its target
    for stage in cached["stages"]:
        assert all(row["worst_batch_deviation"] <= 2 for row in stage["report"]["corpora"])


def test_a_blend_built_before_stages_reads_as_one_stage(stage_lists, tmp_path):
    """A cached blend whose blend.json has no "stages" (not fingerprinted, so its directory and
    index are those of today's plain blend) keeps working."""
    stage0, _, _ = stage_lists
    directory, built = build_blend(staged_spec(tmp_path, [(0, stage0)]))
    path = directory / "blend.json"
    older = json.loads(path.read_text())
    del older["stages"]
    path.write_text(json.dumps(older))
    samples = BlendedSamples(directory)
    assert samples.stage_starts == [0] and samples.stage_of_sample(1000) == 0
    (stage,) = samples.manifest["stages"]
    assert stage["weights"] == built["weights"] and stage["file_list_sha256"] is None
    assert [row["achieved"] for row in stage["report"]["corpora"]] == [
        row["achieved"] for row in built["stages"][0]["report"]["corpora"]
    ]
    again, _ = build_blend(staged_spec(tmp_path, [(0, stage0)]))
    assert again == directory  # a cache hit, not a rebuild
