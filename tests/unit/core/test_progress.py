import io

from goodput.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_off_a_terminal():
    stream = io.StringIO()
    with Progress("tokenize", total_bytes=100, stream=stream, interval_s=0) as progress:
        progress.update(docs=2, tokens=50, nbytes=40)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in stream.getvalue()
    assert "40.0%" in lines[0] and "2 docs, 50 tokens" in lines[0] and "MB/s" in lines[0]


def test_live_bar_on_a_terminal_ends_its_line():
    stream = Terminal()
    with Progress("tokenize", total_bytes=100, stream=stream, interval_s=0) as progress:
        progress.update(docs=1, tokens=10, nbytes=100)
    text = stream.getvalue()
    assert text.startswith("\r\x1b[K") and text.endswith("\n") and "100.0%" in text


def test_no_final_line_after_an_error():
    stream = io.StringIO()
    try:
        with Progress("tokenize", stream=stream, interval_s=60):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert stream.getvalue() == ""
