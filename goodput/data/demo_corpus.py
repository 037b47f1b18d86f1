"""The embedded demo corpus: three domains built from what every CPython 3.11 install ships.

Owns ``build_demo_corpus``, which writes ``<output_dir>/<domain>/<domain>.jsonl`` (one
``{"text": ...}`` object per line, one folder per domain, as real corpora are laid out) for:

* ``code`` — the standard library's ``.py`` files, one document per file;
* ``docs`` — the reference documentation in ``pydoc_data.topics.topics``, one document per topic;
* ``docstrings`` — module, class and function docstrings of the same ``.py`` files, one document
  per module (its docstrings joined by blank lines; modules without any are left out).

Invariants: no network; output is a pure function of the Python install, so reruns are
byte-identical (files are taken in sorted order of their path relative to the stdlib root, topics
in sorted key order); every file is written atomically. Each domain is capped (the ``MAX_*_BYTES``
constants, counted in encoded JSONL bytes) by taking documents in that order until the next one
would not fit, so the demo stays fast. Site-packages, test suites and files that are not valid
UTF-8 are excluded, and so are empty documents.

It does not tokenize, shard or validate; it only writes raw text in the format the readers read.
"""

from __future__ import annotations

import ast
import sysconfig
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from pydoc_data.topics import topics

from goodput.io import json_text, write_text
from goodput.outputs import DATA_DIR, check_output_dir

# Caps per domain, in bytes of JSONL written. The full 3.11 stdlib is ~12.5 MB of code; 8 MB keeps
# tokenizer training and tokenization of the demo to seconds while staying non-trivial.
MAX_CODE_BYTES = 8 << 20
# pydoc topics are ~0.5 MB in total, so this cap is a guard rather than a cut.
MAX_DOCS_BYTES = 2 << 20
# All 3.11 stdlib docstrings come to ~1.9 MB; a guard too, should a later stdlib grow.
MAX_DOCSTRINGS_BYTES = 4 << 20

# Directory names whose contents are not part of the demo: installed third-party packages, test
# suites (``test/``, ``tests/``, ``idlelib/idle_test``) and bytecode caches.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)

_DOCUMENTED_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
# Fields holding statement lists, in the order `ast` declares them (``handlers`` and ``cases``
# hold nodes that have bodies of their own).
_BODY_FIELDS = ("body", "handlers", "orelse", "finalbody", "cases")


def build_demo_corpus(output_dir: Path) -> dict[str, Path]:
    """Write the three demo domains under ``output_dir``; return ``{domain: jsonl_path}``."""
    check_output_dir(Path(output_dir), DATA_DIR, "--output")
    sources = _stdlib_sources(Path(sysconfig.get_paths()["stdlib"]))
    domains = {
        "code": (sources, MAX_CODE_BYTES),
        "docs": ((topics[key] for key in sorted(topics)), MAX_DOCS_BYTES),
        "docstrings": (_module_docstrings(sources), MAX_DOCSTRINGS_BYTES),
    }
    return {
        domain: _write_domain(Path(output_dir), domain, documents, max_bytes)
        for domain, (documents, max_bytes) in domains.items()
    }


def _stdlib_sources(stdlib: Path) -> list[str]:
    """Text of every eligible stdlib ``.py`` file, in sorted relative-path order."""
    paths = sorted(
        (path.relative_to(stdlib).as_posix(), path)
        for path in stdlib.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(path.relative_to(stdlib).parts[:-1])
    )
    sources = []
    for _, path in paths:
        try:
            sources.append(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            continue  # a few installs carry Latin-1 fixtures; the corpus promises UTF-8
    return sources


def _module_docstrings(sources: Iterable[str]) -> Iterator[str]:
    """One document per module that has docstrings: all of them in source order."""
    for source in sources:
        docstrings = list(_docstrings(source))
        if docstrings:
            yield "\n\n".join(docstrings)


def _docstrings(source: str) -> Iterator[str]:
    with warnings.catch_warnings():
        # Old stdlib files use escape sequences that newer parsers warn about; irrelevant here.
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return  # a file another Python version's grammar wrote; skipping keeps it portable
    yield from _walk_docstrings(tree)


def _walk_docstrings(node: ast.AST) -> Iterator[str]:
    """Depth-first in source order, so a module reads top to bottom.

    Only statement bodies are visited: definitions cannot hide inside expressions, and skipping
    those (most of the tree) makes this several times faster than a full ``ast.walk``.
    """
    if isinstance(node, _DOCUMENTED_NODES):
        docstring = ast.get_docstring(node)
        if docstring:
            yield docstring
    for field in _BODY_FIELDS:
        for child in getattr(node, field, ()):
            yield from _walk_docstrings(child)


def _write_domain(output_dir: Path, domain: str, documents: Iterable[str], max_bytes: int) -> Path:
    lines = []
    num_bytes = 0
    for text in documents:
        if text.isspace() or not text:
            continue  # empty modules, such as many __init__.py files, are not documents
        line = json_text({"text": text}, where=output_dir / domain, ensure_ascii=False) + "\n"
        num_bytes += len(line.encode("utf-8"))
        if num_bytes > max_bytes:
            break
        lines.append(line)
    path = output_dir / domain / f"{domain}.jsonl"
    write_text(path, "".join(lines))
    return path
