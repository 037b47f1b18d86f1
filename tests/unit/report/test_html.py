"""The report page: one file that needs nothing else, with outside strings shown as text, and
checked in a real headless Chromium (Debian's ``chromium``, driven by playwright, which never
downloads a browser here): it loads with no console or page error, asks for nothing but
itself, and every figure decodes with a non-zero size."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from goodput.report.html import render_html, write_html
from goodput.report.plots import PLOTS

CHROMIUM = Path("/usr/bin/chromium")


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


def test_the_page_renders_in_chromium(full_run, tmp_path):
    # A skip here fails under GOODPUT_REQUIRE_ALL=1 (tests/conftest.py): CI installs both.
    if not CHROMIUM.is_file():
        pytest.skip(f"needs Debian's chromium at {CHROMIUM} (apt-get install chromium)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="needs playwright (pip install -e '.[dev]')"
    )
    run, acc = full_run
    out = tmp_path / "report.html"
    write_html(run, acc, out)
    url = out.as_uri()
    problems: list[str] = []
    requested: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("request", lambda request: requested.append(request.url))
            page.on("console", lambda m: m.type == "error" and problems.append(m.text))
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.on("dialog", lambda dialog: problems.append(f"dialog: {dialog.message}"))
            page.goto(url, wait_until="load")
            images = page.evaluate(
                "() => Array.from(document.images, i => [i.complete, i.naturalWidth,"
                " i.naturalHeight])"
            )
            text = page.inner_text("body")
            scripts = page.evaluate("() => document.scripts.length")
        finally:
            browser.close()
    assert problems == []
    assert [r for r in requested if not r.startswith("data:")] == [url]
    assert len(images) == len(PLOTS)
    assert all(complete and width > 0 and height > 0 for complete, width, height in images)
    assert hostile_evidence(acc) in text and scripts == 0  # the evidence reads as itself
    assert f"goodput {100 * acc.goodput:.1f}%" in text
