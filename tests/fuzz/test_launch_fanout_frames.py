"""Fuzz the launcher's reader of a step's output (``fanout.Frames``): the tagged answer lines of
every host's task, mixed with the launcher's own lines and with whatever a broken or hostile
node printed.

Properties: any lines give answers only for hosts of the step, each within the bound and never
raising; every host whose own lines came through whole (``frame_lines``) and that no other line
claimed is answered exactly, however the lines interleave with garbage, forged lines and
lines for hosts outside the step; a host claimed by two different answers gets neither.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from goodput.launch.fanout import CHUNK_BYTES, MAGIC, Answer, Frames, frame_lines

HOSTS = ("n1", "n2", "n3")
TAGS = st.sampled_from((*HOSTS, "n4", "0", "x" * 300, "a b", ""))
ANSWERS = st.builds(
    Answer,
    st.one_of(st.none(), st.integers(-255, 255)),
    st.binary(max_size=3 * CHUNK_BYTES),
    st.booleans(),
)
MAX_BYTES = 2 * CHUNK_BYTES
# Lines that are no whole answer line of a host of the step: anything, anything after the magic
# word but a host's tag, an answer line cut short (its base64 no longer decodes).
GARBAGE = st.one_of(
    st.binary(max_size=200),
    st.binary(max_size=120)
    .filter(lambda tail: tail.split()[:1] not in [[host.encode()] for host in HOSTS])
    .map(lambda tail: MAGIC + b" " + tail),
    st.builds(lambda tag, answer: frame_lines(tag, answer)[0][:-3], TAGS, ANSWERS),
)
# Whole answers, for any tag: of this step's hosts, of others, not a tag at all.
WHOLE = st.builds(lambda tag, answer: b"".join(frame_lines(tag, answer)), TAGS, ANSWERS)


def _read(lines: list[bytes]) -> Frames:
    frames = Frames({host: host for host in HOSTS}, MAX_BYTES)
    for line in lines:
        frames.feed(line)
    return frames


@given(st.lists(st.one_of(GARBAGE, WHOLE), max_size=40))
def test_any_lines_answer_only_hosts_of_the_step_within_the_bound(chunks):
    frames = _read(b"\n".join(chunks).split(b"\n"))
    answers = frames.answers()
    assert set(answers) <= set(HOSTS)
    for answer in answers.values():
        assert isinstance(answer, Answer) and len(answer.output) <= MAX_BYTES
    assert len(frames.other) <= 16 and all(len(line) <= 1024 for line in frames.other)


@given(
    st.dictionaries(st.sampled_from(HOSTS), ANSWERS, max_size=3),
    st.lists(GARBAGE, max_size=20),
    st.randoms(use_true_random=False),
)
def test_each_hosts_whole_answer_comes_back_whatever_is_mixed_in(sent, garbage, random):
    lines = [line[:-1] for host, answer in sent.items() for line in frame_lines(host, answer)]
    lines += [line for chunk in garbage for line in chunk.split(b"\n")]
    random.shuffle(lines)
    expected = {host: answer for host, answer in sent.items() if len(answer.output) <= MAX_BYTES}
    assert _read(lines).answers() == expected


@given(st.sampled_from(HOSTS), ANSWERS, ANSWERS)
def test_two_different_answers_for_one_host_answer_for_neither(host, first, second):
    frames = _read([line[:-1] for line in frame_lines(host, first) + frame_lines(host, second)])
    fits = len(first.output) <= MAX_BYTES
    assert frames.answers() == ({host: first} if first == second and fits else {})
