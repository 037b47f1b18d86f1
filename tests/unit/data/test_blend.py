import os

import numpy as np
import pytest

from goodput.data.blend import (
    BlendSpec,
    BlendStage,
    blend_dir,
    build_blend,
    format_report,
    parse_file_list,
)
from goodput.data.loader import BlendedSamples
from goodput.errors import GoodputError


def spec(file_list, tmp_path, **overrides):
    values = {
        "stages": (BlendStage(file_list, 0),),
        "seq_len": 64,
        "num_samples": 2000,
        "seed": 7,
        "cache": tmp_path / "cache",
        "report_batch_size": 64,
    }
    return BlendSpec(**{**values, **overrides})


def test_file_list_parsing(three_corpora):
    file_list, _ = three_corpora
    entries = parse_file_list(file_list)
    assert [(e.weight, e.prefix.name, e.corpus, e.line) for e in entries] == [
        (0.3, "web_a", "web", 3),
        (0.2, "web_b", "web", 4),
        (0.3, "code", "code", 5),
        (0.2, "math", "math", 6),
    ]
    assert all(e.prefix.is_absolute() for e in entries)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("-1 web_a web", "must be positive"),
        ("0 web_a web", "must be positive"),
        ("abc web_a web", "is not a number"),
        ("nan web_a web", "must be positive"),
        ("1 web_a", "expected 3 fields"),
        ("1 nowhere web", "does not exist"),
    ],
)
def test_bad_file_list_lines_name_file_and_line(three_corpora, line, message):
    file_list, _ = three_corpora
    file_list.write_text(f"1 code code\n{line}\n")
    with pytest.raises(GoodputError, match=message) as exc:
        parse_file_list(file_list)
    assert exc.value.render().startswith(f"{file_list}:2:")


def test_empty_or_missing_file_list(tmp_path):
    with pytest.raises(GoodputError, match="No such file"):
        parse_file_list(tmp_path / "none.txt")
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(GoodputError, match="no entries"):
        parse_file_list(tmp_path / "empty.txt")


def test_every_prefix_and_every_batch_honours_the_mixture(three_corpora, tmp_path):
    file_list, _ = three_corpora
    directory, manifest = build_blend(spec(file_list, tmp_path))
    corpus_index = np.load(directory / "corpus_index.npy")
    weights = np.array([w for _, w in manifest["weights"]])
    assert [name for name, _ in manifest["weights"]] == ["web", "code", "math"]
    assert np.allclose(weights, [0.5, 0.3, 0.2])
    counts = np.cumsum(np.eye(3)[corpus_index], axis=0)
    n = np.arange(1, len(corpus_index) + 1)[:, None]
    assert np.abs(counts - weights * n).max() <= 1 + 1e-9
    for row in manifest["report"]["corpora"]:
        assert row["worst_batch_deviation"] < 2
        assert abs(row["achieved"] - row["target"]) < 1e-3


def test_samples_are_windows_of_the_seeded_document_stream(three_corpora, tmp_path):
    file_list, docs = three_corpora
    directory, manifest = build_blend(spec(file_list, tmp_path))
    samples = BlendedSamples(directory)
    all_docs = {tuple(d.tolist()) for corpus in docs.values() for d in corpus}
    seen = set()
    for i in range(0, 2000, 37):
        sample = samples[i]
        assert sample.shape == (65,) and sample.dtype == np.int64
        seen.add(tuple(sample.tolist()))
    # Every EOD-delimited piece strictly inside a sample is a whole document of its corpus.
    for sample in seen:
        pieces = np.split(np.array(sample), np.flatnonzero(np.array(sample) == 0) + 1)[1:-1]
        for piece in pieces:
            assert tuple(piece.tolist()) in all_docs
    assert len(seen) > 40  # distinct windows, not one repeated sample


def test_deterministic_and_content_addressed(three_corpora, tmp_path):
    file_list, _ = three_corpora
    first, manifest = build_blend(spec(file_list, tmp_path))
    again, _ = build_blend(spec(file_list, tmp_path / "elsewhere"))
    assert first.name == again.name
    for name in ("corpus_index.npy", "sample_index.npy", "corpus_0000.npy"):
        assert (first / name).read_bytes() == (again / name).read_bytes()
    file_indices = sorted((tmp_path / "cache" / "files").iterdir())
    stamps = [os.stat(p / "document_order.npy").st_mtime_ns for p in file_indices]
    # A weight change rebuilds only the blend; per-file indices are reused untouched.
    file_list.write_text(file_list.read_text().replace("0.2 math", "0.6 math"))
    reweighted, _ = build_blend(spec(file_list, tmp_path))
    assert reweighted != first
    assert sorted((tmp_path / "cache" / "files").iterdir()) == file_indices
    assert [os.stat(p / "document_order.npy").st_mtime_ns for p in file_indices] == stamps
    assert build_blend(spec(file_list, tmp_path, seed=8))[0] not in (first, reweighted)


def test_exhausted_corpus_repeats_loudly_or_is_refused(three_corpora, tmp_path):
    file_list, _ = three_corpora
    big = spec(file_list, tmp_path, num_samples=20000)
    directory, manifest = build_blend(big)
    math_row = next(r for r in manifest["report"]["corpora"] if r["corpus"] == "math")
    assert math_row["epochs"] > 1
    assert "WARNING: corpus 'math' is REPEATED" in format_report(directory, manifest)
    order = np.load(directory / "corpus_0002.npy")
    available = math_row["available"]
    assert sorted(order[:available].tolist()) == list(range(available))  # a true epoch
    assert not np.array_equal(order[:available], order[available : 2 * available])  # reshuffled
    with pytest.raises(GoodputError, match=r"corpus '\w+' needs .* samples but holds") as exc:
        build_blend(spec(file_list, tmp_path, num_samples=20000, on_exhausted="error"))
    assert exc.value.render().startswith(str(file_list))


def test_cached_blend_reports_at_the_asked_batch_size(three_corpora, tmp_path):
    file_list, _ = three_corpora
    first, manifest = build_blend(spec(file_list, tmp_path))
    again, cached = build_blend(spec(file_list, tmp_path, report_batch_size=1000))
    assert again == first and manifest["report"]["batch_size"] == 64
    assert cached["report"]["batch_size"] == 1000
    assert cached["report"]["corpora"] != manifest["report"]["corpora"]


@pytest.mark.parametrize(
    "hostile", ["../../etc", "a" * 19, "ABCDEF0123456789ABCD", "0" * 20 + "/x", ""]
)
def test_a_fingerprint_from_outside_never_becomes_a_path(tmp_path, hostile):
    with pytest.raises(GoodputError, match="is not hex"):
        blend_dir(tmp_path, hostile)
    assert (
        blend_dir(tmp_path, "0123456789abcdef" * 4) == tmp_path / "blends" / "0123456789abcdef0123"
    )
