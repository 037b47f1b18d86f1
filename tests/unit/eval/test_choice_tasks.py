"""Reading multiple-choice tasks: each public layout (both ARC variants) becomes the prompts
lm-eval builds, and every hostile or broken line is one GoodputError naming file:line."""

import json

import pytest

from goodput.errors import GoodputError
from goodput.eval.choice_tasks import (
    MAX_CHOICES,
    MAX_LINE_BYTES,
    MAX_TEXT_CHARS,
    ChoiceItem,
    read_choice_task,
)

ARC_NESTED = {
    "id": "Mercury_7175875",
    "question": {
        "stem": "An astronomer observes that a planet rotates faster. What is the likely cause?",
        "choices": [
            {"text": "The planet's density will decrease.", "label": "A"},
            {"text": "The planet's rotation period will shorten.", "label": "B"},
            {"text": "The planet's gravity will become stronger.", "label": "C"},
        ],
    },
    "answerKey": "B",
}
ARC_FLAT = {
    "id": "Mercury_7175875",
    "question": "Which is a mammal?",
    "choices": {"text": ["shark", "whale", "trout", "eel"], "label": ["1", "2", "3", "4"]},
    "answerKey": "2",
}
HELLASWAG = {
    "ind": 24,
    "activity_label": "Roof shingle removal",
    "ctx_a": "A man is sitting on a roof.",
    "ctx_b": "he",
    "ctx": "A man is sitting on a roof. he",
    "endings": [
        "is using wrap to wrap a pair of skis.",
        "is ripping level tiles off.",
        "is holding a rubik's cube.",
        "starts pulling up roofing on a roof.",
    ],
    "label": "3",
}
HELLASWAG_WIKIHOW = {
    "activity_label": "Home and Garden",
    "ctx_a": "[header] How to grow basil [title] Pick a sunny spot.",
    "ctx_b": "",
    "endings": ["[step] Water it  daily.", "Plant it in the dark.", "Eat it.", "Sell it."],
    "label": 0,
}
PIQA = {
    "goal": "How do I ready a guinea pig cage for it's new occupants?",
    "sol1": "Provide the guinea pig with a cage full of a few inches of bedding.",
    "sol2": "Provide the guinea pig with a cage full of a few inches of jeans material.",
    "label": 0,
}


def write(tmp_path, lines, name="task.jsonl"):
    path = tmp_path / name
    data = [line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines]
    path.write_bytes(b"\n".join(data) + b"\n")
    return path


def test_arc_in_ai2s_nested_layout(tmp_path):
    (item,) = read_choice_task(write(tmp_path, [ARC_NESTED]), "arc")
    assert item == ChoiceItem(
        "Question: An astronomer observes that a planet rotates faster. What is the likely "
        "cause?\nAnswer:",
        (
            " The planet's density will decrease.",
            " The planet's rotation period will shorten.",
            " The planet's gravity will become stronger.",
        ),
        1,
    )


def test_arc_in_the_flat_hugging_face_layout(tmp_path):
    (item,) = read_choice_task(write(tmp_path, [ARC_FLAT]), "arc")
    assert item == ChoiceItem(
        "Question: Which is a mammal?\nAnswer:", (" shark", " whale", " trout", " eel"), 1
    )


def test_hellaswag_context_as_lm_eval_builds_it(tmp_path):
    plain, wikihow = read_choice_task(write(tmp_path, [HELLASWAG, HELLASWAG_WIKIHOW]), "hellaswag")
    assert plain == ChoiceItem(
        "Roof shingle removal: A man is sitting on a roof. He",
        tuple(" " + ending for ending in HELLASWAG["endings"]),
        3,
    )
    # Stripped, " [title]" -> ". ", tags dropped, one pass of double spaces folded: the space
    # a leading tag leaves stays, as in lm-eval's prompt.
    assert wikihow == ChoiceItem(
        "Home and Garden: How to grow basil. Pick a sunny spot.",
        ("  Water it daily.", " Plant it in the dark.", " Eat it.", " Sell it."),
        0,
    )


def test_hellaswag_with_ctx_alone_and_without_an_activity_label(tmp_path):
    record = {"ctx": "A man is sitting on a roof. he", "endings": ["a", "b", "c", "d"], "label": 2}
    (item,) = read_choice_task(write(tmp_path, [record]), "hellaswag")
    assert item == ChoiceItem("A man is sitting on a roof. he", (" a", " b", " c", " d"), 2)
    # ctx_b.capitalize() lowercases the rest, as lm-eval's prompt does.
    record = {"ctx_a": "Then", "ctx_b": "the MAN", "endings": ["x", "y"], "label": "0"}
    (item,) = read_choice_task(write(tmp_path, [record]), "hellaswag")
    assert item.context == "Then The man"


def test_piqa(tmp_path):
    (item,) = read_choice_task(write(tmp_path, [PIQA]), "piqa")
    assert item == ChoiceItem(
        f"Question: {PIQA['goal']}\nAnswer:", (f" {PIQA['sol1']}", f" {PIQA['sol2']}"), 0
    )


def test_blank_lines_crlf_and_a_limit(tmp_path):
    path = tmp_path / "task.jsonl"
    good = json.dumps(PIQA).encode()
    path.write_bytes(b"\n".join([good + b"\r", b"", b"   ", good, good, b"{broken"]))
    assert len(read_choice_task(path, "piqa", limit=3)) == 3  # the broken line is never read
    assert len(read_choice_task(path, "piqa", limit=1)) == 1
    with pytest.raises(GoodputError, match=r"task.jsonl:6: malformed JSON"):
        read_choice_task(path, "piqa")


def test_unknown_layout_and_bad_limit(tmp_path):
    path = write(tmp_path, [PIQA])
    with pytest.raises(
        GoodputError, match="unknown layout 'mmlu'; use one of: arc, hellaswag, piqa"
    ):
        read_choice_task(path, "mmlu")
    with pytest.raises(GoodputError, match="not a positive count"):
        read_choice_task(path, "piqa", limit=0)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(GoodputError, match="nope.jsonl: No such file"):
        read_choice_task(tmp_path / "nope.jsonl", "arc")
    with pytest.raises(GoodputError, match="is a folder, not a regular file"):
        read_choice_task(tmp_path, "arc")
    (tmp_path / "empty.jsonl").write_bytes(b"\n\n")
    with pytest.raises(GoodputError, match="empty.jsonl: holds no items"):
        read_choice_task(tmp_path / "empty.jsonl", "arc")


def with_(record, **changes):
    return {**record, **changes}


def without(record, key):
    return {k: v for k, v in record.items() if k != key}


def arc_flat_with_choices(count):
    labels = [f"L{i}" for i in range(count)]
    return with_(ARC_FLAT, choices={"text": ["x"] * count, "label": labels}, answerKey="L0")


HOSTILE = {
    "broken JSON": ("piqa", b'{"goal": "g", "sol1": ', "malformed JSON: Expecting value"),
    "not an object": ("piqa", b'["goal", "sol1"]', "expected a JSON object, got an array"),
    "missing field": ("piqa", without(PIQA, "sol2"), "no 'sol2' field; keys present: \"goal\""),
    "missing nested field": (
        "arc",
        with_(ARC_NESTED, question=without(ARC_NESTED["question"], "stem")),
        "no 'question.stem' field",
    ),
    "label out of range": ("piqa", with_(PIQA, label=2), "'label' 2 is out of range for 2"),
    "negative label": ("hellaswag", with_(HELLASWAG, label=-1), "'label' -1 is out of range"),
    "label a boolean": ("piqa", with_(PIQA, label=True), "'label' is true, not a choice index"),
    "label a float": ("piqa", with_(PIQA, label=1.0), "'label' is 1.0, not a choice index"),
    "no label (a test split)": ("hellaswag", with_(HELLASWAG, label=""), "the item has no answer"),
    "answerKey not a label": ("arc", with_(ARC_FLAT, answerKey="E"), 'answerKey "E" is none'),
    "labels repeat": (
        "arc",
        with_(ARC_FLAT, choices={"text": ["a", "b"], "label": ["A", "A"]}, answerKey="A"),
        "the choice labels repeat",
    ),
    "ragged ARC lists": (
        "arc",
        with_(ARC_FLAT, choices={"text": ["a", "b", "c"], "label": ["A", "B"]}, answerKey="A"),
        "choices.text has 3 entries but choices.label 2",
    ),
    "question a number": ("arc", with_(ARC_FLAT, question=3), "'question' is a number"),
    "10 MB line": (
        "piqa",
        json.dumps(with_(PIQA, goal="g" * 10_000_000)).encode(),
        f"is a line longer than {MAX_LINE_BYTES:,} bytes",
    ),
    "100 choices": (
        "arc",
        arc_flat_with_choices(100),
        "has 100 entries; an item has 2 to 16 choices",
    ),
    "one choice": ("arc", arc_flat_with_choices(1), "has 1 entries; an item has 2 to 16"),
    "17 endings": (
        "hellaswag",
        with_(HELLASWAG, endings=["e"] * (MAX_CHOICES + 1)),
        "'endings' has 17 entries",
    ),
    "empty text": ("piqa", with_(PIQA, sol1="  "), "'sol1' is empty"),
    "empty ARC choice": (
        "arc",
        with_(ARC_FLAT, choices={"text": ["a", ""], "label": ["A", "B"]}),
        "'choices.text[1]' is empty",
    ),
    "empty once the tags are gone": (
        "hellaswag",
        with_(HELLASWAG, endings=["a", "[header]", "c", "d"]),
        "endings[1] is empty once its WikiHow [tags] are removed",
    ),
    "text too long": (
        "piqa",
        with_(PIQA, goal="g" * (MAX_TEXT_CHARS + 1)),
        f"'goal' is {MAX_TEXT_CHARS + 1} characters, more than {MAX_TEXT_CHARS}",
    ),
    "text not a string": ("hellaswag", with_(HELLASWAG, ctx_a=["x"]), "'ctx_a' is an array"),
    "non-UTF-8 bytes": ("piqa", b'{"goal": "caf\xe9"}', "invalid UTF-8 at byte 13 of the line"),
    "unpaired surrogate": (
        "piqa",
        b'{"goal": "\\ud800", "sol1": "a", "sol2": "b", "label": 0}',
        "'goal' holds an unpaired surrogate",
    ),
    "duplicate key": ("piqa", b'{"label": 0, "label": 1}', 'key "label" appears twice'),
    "NaN": ("piqa", b'{"label": NaN}', "NaN is not valid JSON"),
    "deep nesting": ("piqa", b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply"),
    "huge integer": ("piqa", b'{"label": ' + b"9" * 5000 + b"}", "unreadable JSON"),
    "ARC choice not an object": (
        "arc",
        with_(ARC_NESTED, question={"stem": "s", "choices": ["a", "b"]}),
        "question.choices[0] is a string, not an object",
    ),
}


@pytest.mark.parametrize("case", HOSTILE, ids=str)
def test_hostile_lines_are_one_line_errors_naming_file_and_line(tmp_path, case):
    layout, bad, what = HOSTILE[case]
    good = {"arc": ARC_NESTED, "hellaswag": HELLASWAG, "piqa": PIQA}[layout]
    path = write(tmp_path, [good, b"", bad, good])
    with pytest.raises(GoodputError) as caught:
        read_choice_task(path, layout)
    message = caught.value.render()
    assert message.startswith(f"{path}:3: ")
    assert what in message
    assert "\n" not in message and len(message) < 600  # quoted outside data stays bounded


def test_tag_cleaning_is_linear_on_hostile_brackets(tmp_path):
    opening = with_(HELLASWAG, ctx_a="[" * (MAX_TEXT_CHARS - 10) + " x")
    (item,) = read_choice_task(write(tmp_path, [opening]), "hellaswag")
    assert item.context.endswith("[ x He")
    nested = with_(HELLASWAG, ctx_a="keep [a[b] this [open\n[gone] too")
    (item,) = read_choice_task(write(tmp_path, [nested]), "hellaswag")
    assert item.context == "Roof shingle removal: keep this [open\n too He"
