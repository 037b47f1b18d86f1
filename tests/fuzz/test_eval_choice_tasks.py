"""Fuzz the multiple-choice task reader: any bytes, and JSON lines shaped like each layout with
any value in any field, give valid items or one GoodputError naming the file, under every
layout."""

import json

from hypothesis import given
from hypothesis import strategies as st

from goodput.errors import GoodputError
from goodput.eval.choice_tasks import LAYOUTS, MAX_CHOICES, ChoiceItem, read_choice_task
from goodput.testing import fuzz

layouts = st.sampled_from(sorted(LAYOUTS))
values = fuzz.json_values("A", "1", 0, 1, "0", "[title]", " [step] x")
texts = st.text(max_size=12) | st.sampled_from(["a", " b", "[x] y", "]["])
text_lists = st.lists(texts, min_size=1, max_size=5)
field_values = values | texts | text_lists | st.integers(-2, 5).map(str)

# Records shaped like each layout, every field drawn from JSON values or plausible ones.
SHAPES = {
    "arc": st.fixed_dictionaries(
        {
            "question": st.fixed_dictionaries(
                {
                    "stem": texts | values,
                    "choices": st.lists(
                        st.fixed_dictionaries({"text": texts | values, "label": texts | values}),
                        max_size=4,
                    )
                    | values,
                }
            )
            | texts,
            "choices": st.fixed_dictionaries({"text": text_lists, "label": text_lists}) | values,
            "answerKey": field_values,
        }
    ),
    "hellaswag": st.fixed_dictionaries(
        {"ctx_a": texts | values, "endings": text_lists | values, "label": field_values},
        optional={"activity_label": texts | values, "ctx_b": texts | values, "ctx": texts},
    ),
    "piqa": st.fixed_dictionaries(
        {"goal": texts | values, "sol1": texts | values, "sol2": texts, "label": field_values}
    ),
}
any_records = st.one_of(*SHAPES.values()) | values


def read_or_refuse(path, layout):
    try:
        items = read_choice_task(path, layout)
    except GoodputError as error:
        message = error.render()
        assert "\n" not in message and message.startswith(str(path))
        return
    for item in items:
        assert isinstance(item, ChoiceItem) and 2 <= len(item.choices) <= MAX_CHOICES
        assert 0 <= item.answer < len(item.choices)
        for text in (item.context, *item.choices):
            assert isinstance(text, str) and text.strip()
            text.encode("utf-8")  # scoring measures and tokenizes it


@given(data=st.binary(max_size=400), layout=layouts)
def test_random_bytes(tmp_path, data, layout):
    path = tmp_path / "task.jsonl"
    path.write_bytes(data)
    read_or_refuse(path, layout)


@given(data=st.data(), layout=layouts, cut=st.integers(0, 30))
def test_json_lines(tmp_path, data, layout, cut):
    records = SHAPES[layout] | any_records  # mostly this layout's shape, sometimes another's
    lines = data.draw(st.lists(records.map(json.dumps) | st.text(max_size=20), max_size=6))
    raw = "\n".join(lines).encode("utf-8", "surrogatepass")
    path = tmp_path / "task.jsonl"
    path.write_bytes(raw[: len(raw) - cut] if cut < len(raw) else raw)
    read_or_refuse(path, layout)
