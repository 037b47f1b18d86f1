"""The report page: one file that needs nothing else, with outside strings shown as text, and
checked in a real headless Chromium (Debian's ``chromium``, driven by playwright, which never
downloads a browser here): it loads with no console or page error, asks for nothing but
itself, and every figure decodes with a non-zero size."""

from __future__ import annotations

import re

import pytest

from goodput.report.html import render_html, write_html
from goodput.report.plots import PLOTS


@pytest.fixture(scope="module")
def page(full_run) -> str:
    return render_html(*full_run)


def hostile_evidence(acc) -> str:
    """The first attempt's evidence line: markup (conftest)."""
    line = acc.attempts[0].evidence
    assert line == "<script>alert(1)</script>"
    return line


def test_outside_strings_are_text_not_markup(full_run, page):
    _, acc = full_run
    assert hostile_evidence(acc) not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the evidence line
    assert "run&lt;b&gt;&amp;amp;" in page and "run<b>" not in page  # the run directory
    assert "<script" not in page


def test_the_page_needs_nothing_beside_itself(page):
    sources = re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]*)""", page)
    assert len(sources) == len(PLOTS)
    assert all(source.startswith("data:image/png;base64,") for source in sources)
    assert "url(" not in page and "@import" not in page


def test_it_is_written_atomically(full_run, page, tmp_path):
    out = tmp_path / "report.html"
    out.write_text("old")
    write_html(*full_run, out)
    assert out.read_text() == page
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temp file left


def test_the_page_renders_in_chromium(full_run, tmp_path, render_in_chromium):
    run, acc = full_run
    out = tmp_path / "report.html"
    write_html(run, acc, out)
    rendered = render_in_chromium(
        out,
        {
            "images": "() => Array.from(document.images, i => [i.complete, i.naturalWidth,"
            " i.naturalHeight])",
            "text": "() => document.body.innerText",
            "scripts": "() => document.scripts.length",
        },
    )
    images, text, scripts = (rendered.values[k] for k in ("images", "text", "scripts"))
    problems = rendered.problems
    assert problems == []
    assert rendered.requested == [out.as_uri()]
    assert len(images) == len(PLOTS)
    assert all(complete and width > 0 and height > 0 for complete, width, height in images)
    assert hostile_evidence(acc) in text and scripts == 0  # the evidence reads as itself
    assert f"goodput {100 * acc.goodput:.1f}%" in text
