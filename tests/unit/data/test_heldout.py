"""The blend's held-out slice per corpus (``holdout_samples``): never a training sample, the
same whatever the run's length, pinned in the manifest, and checked when read."""

import hashlib
import json

import numpy as np
import pytest

from goodput.cli import main
from goodput.data.blend import BlendSpec, BlendStage, build_blend, corpus_order, heldout_samples
from goodput.data.loader import BlendedSamples
from goodput.errors import GoodputError
from goodput.io import sha256_file


def spec(file_list, tmp_path, **overrides):
    values = {
        "stages": (BlendStage(file_list, 0),),
        "seq_len": 64,
        "num_samples": 2000,
        "seed": 7,
        "cache": tmp_path / "cache",
        "report_batch_size": 64,
        "holdout_samples": 8,
    }
    return BlendSpec(**{**values, **overrides})


def test_heldout_samples_are_never_trained_on(three_corpora, tmp_path):
    file_list, _ = three_corpora
    directory, manifest = build_blend(spec(file_list, tmp_path))
    samples = BlendedSamples(directory)
    assert manifest["holdout_samples"] == 8
    assert "holdout_samples" in manifest["components"]
    for c, row in enumerate(manifest["report"]["corpora"]):
        held = samples.heldout_numbers[c]
        assert len(held) == 8 and row["heldout"] == 8
        trained = np.asarray(samples.corpus_orders[c])
        assert not np.isin(trained, held).any(), row["corpus"]
        # Every epoch is a permutation of exactly the other samples.
        pool = row["available"] - 8
        first_epoch = trained[: min(pool, len(trained))]
        assert len(set(first_epoch.tolist())) == len(first_epoch)
        assert row["epochs"] == pytest.approx(row["samples"] / pool)
    # The held-out sample is the corpus's sample of that number, like any other.
    plain = BlendedSamples(build_blend(spec(file_list, tmp_path, holdout_samples=0))[0])
    math_c = samples.corpus_names.index("math")
    np.testing.assert_array_equal(
        samples.heldout(math_c, 3),
        plain._corpus_sample(math_c, int(samples.heldout_numbers[math_c][3])),
    )


def test_no_holdout_keeps_the_blend_as_it_was(three_corpora, tmp_path):
    """holdout 0 is the blend goodput always built: same fingerprint, same samples."""
    file_list, _ = three_corpora
    directory, manifest = build_blend(spec(file_list, tmp_path, holdout_samples=0))
    assert "holdout_samples" not in manifest and "holdout_samples" not in manifest["components"]
    order = corpus_order("web", 500, 1200, 7)
    rng = np.random.default_rng([7, int(hashlib.sha256(b"web").hexdigest()[:16], 16), 0])
    np.testing.assert_array_equal(order[:500], rng.permutation(500))
    held, _ = build_blend(spec(file_list, tmp_path))
    assert held != directory


def test_heldout_does_not_depend_on_the_run_length(three_corpora, tmp_path):
    file_list, _ = three_corpora
    short = BlendedSamples(build_blend(spec(file_list, tmp_path, num_samples=500))[0])
    long = BlendedSamples(build_blend(spec(file_list, tmp_path, num_samples=4000))[0])
    for c in range(len(short.corpus_names)):
        np.testing.assert_array_equal(short.heldout_numbers[c], long.heldout_numbers[c])
        # and the longer run's order extends the shorter one's (a lengthened run's resume)
        n = len(short.corpus_orders[c])
        np.testing.assert_array_equal(long.corpus_orders[c][:n], short.corpus_orders[c])


def test_corpus_order_skips_exactly_the_heldout_numbers():
    held = heldout_samples("web", 50, 7, 3)
    order = corpus_order("web", 50, 43 * 3, 3, held)
    for epoch in range(3):
        assert sorted(order[43 * epoch : 43 * (epoch + 1)].tolist()) == sorted(
            set(range(50)) - set(held.tolist())
        )


def test_holding_out_a_whole_corpus_is_refused(three_corpora, tmp_path):
    file_list, _ = three_corpora
    small = BlendedSamples(build_blend(spec(file_list, tmp_path, holdout_samples=0))[0])
    math_available = next(
        r["available"] for r in small.manifest["report"]["corpora"] if r["corpus"] == "math"
    )
    with pytest.raises(GoodputError, match="leaves none to train on") as exc:
        build_blend(spec(file_list, tmp_path, holdout_samples=math_available))
    assert exc.value.render().startswith("math:")
    with pytest.raises(GoodputError, match="holdout samples"):
        build_blend(spec(file_list, tmp_path, holdout_samples=-1))


def test_damaged_heldout_index_is_refused(three_corpora, tmp_path):
    """A held-out index whose numbers are out of range, even with its checksum re-recorded
    (the fingerprint does not cover checksums), is one line naming the file."""
    file_list, _ = three_corpora
    directory, _ = build_blend(spec(file_list, tmp_path))
    path = directory / "heldout_0000.npy"
    bad = np.full(8, 10**9, np.int64)
    path.chmod(0o644)
    np.save(path, bad, allow_pickle=False)
    manifest = json.loads((directory / "blend.json").read_text())
    manifest["index_sha256"]["heldout_0000.npy"] = sha256_file(path)
    (directory / "blend.json").write_text(json.dumps(manifest))
    with pytest.raises(GoodputError, match="sorted list of distinct sample numbers") as exc:
        BlendedSamples(directory)
    assert str(path) in exc.value.render()


def test_edited_holdout_count_is_refused(three_corpora, tmp_path):
    file_list, _ = three_corpora
    directory, _ = build_blend(spec(file_list, tmp_path))
    manifest = json.loads((directory / "blend.json").read_text())
    del manifest["holdout_samples"]
    (directory / "blend.json").write_text(json.dumps(manifest))
    with pytest.raises(GoodputError, match="fingerprint mismatch: holdout_samples"):
        BlendedSamples(directory)
    manifest["holdout_samples"] = "8"
    (directory / "blend.json").write_text(json.dumps(manifest))
    with pytest.raises(GoodputError, match="holdout_samples"):
        BlendedSamples(directory)


def test_blend_command_holds_samples_out(three_corpora, tmp_path, capsys):
    file_list, _ = three_corpora
    args = ["data", "blend", str(file_list), "--seq-len", "64", "--num-samples", "300"]
    args += ["--seed", "1", "--cache", str(tmp_path / "cache")]
    assert main([*args, "--holdout-samples", "5", "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["holdout_samples"] == 5
    with pytest.raises(SystemExit) as exc:
        main([*args, "--holdout-samples", "-2"])
    assert exc.value.code == 2
    assert "--holdout-samples" in capsys.readouterr().err
