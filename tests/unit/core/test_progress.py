"""One progress reporter, two modes: plain periodic lines in a batch log (timed by an injected
clock, so exact), and a rich bar on a terminal (a console writing to a StringIO)."""

import io
import re

from rich.console import Console

from goodput.progress import Progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_plain_lines_every_interval_and_a_closing_line():
    stream, clock = io.StringIO(), Clock()
    with Progress(
        "tokenize", total=4_000_000, unit="bytes", stream=stream, interval_s=10, clock=clock
    ) as progress:
        clock.now += 4
        progress.advance(1_000_000, docs=2, tokens=50)  # within the interval: no line
        clock.now += 6
        progress.advance(1_000_000, docs=2, tokens=50)
        clock.now += 10
        progress.advance(2_000_000, docs=4, tokens=100)
    assert stream.getvalue().splitlines() == [
        "tokenize: 50.0% 2.0 MB of 4.0 MB, 4 docs, 100 tokens, 200.0 kB/s, 0.4 docs/s, "
        "10 tokens/s, 0:00:10, about 0:00:10 left",
        "tokenize: 100.0% 4.0 MB of 4.0 MB, 8 docs, 200 tokens, 200.0 kB/s, 0.4 docs/s, "
        "10 tokens/s, 0:00:20",
        "tokenize: 100.0% 4.0 MB of 4.0 MB, 8 docs, 200 tokens in 0:00:20 "
        "(200.0 kB/s, 0.4 docs/s, 10 tokens/s)",
    ]


def test_a_count_without_a_total_has_no_percent():
    stream, clock = io.StringIO(), Clock()
    with Progress("broadcast", unit="hosts", stream=stream, interval_s=0, clock=clock) as progress:
        clock.now += 2
        progress.advance(3)
    first, last = stream.getvalue().splitlines()
    assert first == "broadcast: 3 hosts, 1.5 hosts/s, 0:00:02"
    assert last == "broadcast: 3 hosts in 0:00:02 (1.5 hosts/s)"


def test_work_done_within_one_interval_stays_quiet():
    stream = io.StringIO()
    with Progress("blend: file indices", total=3, unit="files", stream=stream) as progress:
        progress.advance(3)
    assert stream.getvalue() == ""


def test_no_closing_line_after_an_error():
    stream, clock = io.StringIO(), Clock()
    try:
        with Progress("tokenize", stream=stream, interval_s=1, clock=clock) as progress:
            clock.now += 1
            progress.advance(1)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert len(stream.getvalue().splitlines()) == 1  # the periodic line only


def test_a_terminal_gets_a_rich_bar_whose_last_frame_stays():
    output, clock = io.StringIO(), Clock()
    console = Console(file=output, force_terminal=True, width=160)
    with Progress("tokenize", total=100, unit="bytes", console=console, clock=clock) as progress:
        clock.now += 2
        progress.advance(100, docs=1, tokens=10)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.getvalue())  # colours, cursor moves
    last = text.rstrip("\n").splitlines()[-1]
    assert last.startswith("tokenize") and "100%" in last and "0:00:02" in last
    assert "100 B of 100 B, 1 docs, 10 tokens, 50 B/s" in last
    assert text.endswith("\n")  # the line is ended: what follows starts clean


def test_a_tty_stream_alone_chooses_the_bar():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    with Progress("eval", total=2, unit="requests", stream=stream) as progress:
        progress.advance(2)
    assert "2 of 2 requests" in stream.getvalue()


def test_show_false_writes_nothing_on_a_terminal_either():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    with Progress("eval", total=2, stream=stream, interval_s=0, show=False) as progress:
        progress.advance(2)
    assert stream.getvalue() == "" and progress.done == 2


def test_live_false_writes_plain_lines_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream, clock = Terminal(), Clock()
    with Progress(
        "checkpoint save",
        total=4,
        unit="bytes",
        stream=stream,
        interval_s=0,
        clock=clock,
        live=False,
    ) as progress:
        clock.now += 1
        progress.advance(4)
    assert stream.getvalue().splitlines() == [
        "checkpoint save: 100.0% 4 B of 4 B, 4 B/s, 0:00:01",
        "checkpoint save: 100.0% 4 B of 4 B in 0:00:01 (4 B/s)",
    ]
