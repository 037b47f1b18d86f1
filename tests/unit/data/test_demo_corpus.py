"""The embedded demo corpus: three non-trivial domains, byte-identical on every build."""

import json

import pytest

from goodput.data import demo_corpus
from goodput.data.readers import ReadStats, iter_texts

DOMAINS = ("code", "docs", "docstrings")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    output = tmp_path_factory.mktemp("demo")
    return output, demo_corpus.build_demo_corpus(output)


def test_one_folder_and_file_per_domain(built):
    output, paths = built
    assert paths == {domain: output / domain / f"{domain}.jsonl" for domain in DOMAINS}
    # Atomic writes leave no temp files behind.
    assert sorted(p.relative_to(output).as_posix() for p in output.rglob("*") if p.is_file()) == [
        f"{domain}/{domain}.jsonl" for domain in DOMAINS
    ]


@pytest.mark.parametrize(
    ("domain", "cap", "min_bytes", "min_docs"),
    [
        ("code", demo_corpus.MAX_CODE_BYTES, 4 << 20, 300),
        ("docs", demo_corpus.MAX_DOCS_BYTES, 200_000, 50),
        ("docstrings", demo_corpus.MAX_DOCSTRINGS_BYTES, 500_000, 300),
    ],
)
def test_domains_are_non_trivial_and_capped(built, domain, cap, min_bytes, min_docs):
    path = built[1][domain]
    assert min_bytes < path.stat().st_size <= cap
    # Split on b"\n" only: JSON leaves U+2028 and friends unescaped, str.splitlines would not.
    records = [json.loads(line) for line in path.read_bytes().split(b"\n")[:-1]]
    assert len(records) >= min_docs
    assert all(list(record) == ["text"] and record["text"].strip() for record in records)


def test_readers_read_every_document(built):
    for path in built[1].values():
        stats = ReadStats()
        num_documents = sum(1 for _ in iter_texts(path, stats=stats))
        assert num_documents == path.read_bytes().count(b"\n")
        assert stats.num_empty_skipped == 0
        assert stats.num_bytes == path.stat().st_size


def test_code_starts_with_the_first_stdlib_files(built):
    first = json.loads(built[1]["code"].open(encoding="utf-8").readline())["text"]
    assert "all_feature_names" in first  # __future__.py sorts first


def test_source_selection_is_sorted_and_excludes_tests_packages_and_non_utf8(tmp_path):
    files = {
        "b.py": "b",
        "a/z.py": "a/z",
        "a.py": "a",
        "test/t.py": "test",
        "pkg/tests/t.py": "tests",
        "idlelib/idle_test/t.py": "idle_test",
        "site-packages/s.py": "site",
        "notes.txt": "not python",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "latin1.py").write_bytes("caf\xe9 = 1".encode("latin-1"))
    assert demo_corpus._stdlib_sources(tmp_path) == ["a", "a/z", "b"]


def test_docstrings_in_source_order():
    source = '''"""Module."""

class A:
    """Class A."""

    def f(self):
        """Method f."""

if True:
    def g():
        """Nested in if."""
try:
    pass
except ImportError:
    def h():
        """In handler."""
'''
    assert list(demo_corpus._module_docstrings([source, "x = 1"])) == [
        "Module.\n\nClass A.\n\nMethod f.\n\nNested in if.\n\nIn handler."
    ]


def test_rebuild_is_byte_identical(built, tmp_path):
    first = built[1]
    second = demo_corpus.build_demo_corpus(tmp_path)
    for domain in DOMAINS:
        assert first[domain].read_bytes() == second[domain].read_bytes(), domain
