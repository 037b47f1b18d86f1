"""Multiple-choice tasks read from local JSONL files in their public layouts.

Owns ``ChoiceItem`` (a context, the continuations a model scores after it, the right one's index)
and ``read_choice_task(path, layout)`` for the layouts in ``LAYOUTS``: ``arc`` (AI2 ARC, both its
own nested JSONL and the flat Hugging Face export), ``hellaswag`` and ``piqa``. Each line is one
item, built into the prompt lm-eval's task of the same name uses, so scores compare with its own:

* arc: ``"Question: {stem}\\nAnswer:"``, continuations ``" {text}"``, the answer where the choice's
  ``label`` equals ``answerKey``;
* hellaswag: ``"{activity_label}: {ctx_a} {ctx_b.capitalize()}"`` (or ``ctx`` for ``ctx_a`` and
  ``ctx_b``), continuations ``" {ending}"``, both cleaned of the WikiHow ``[tags]``; answer
  ``label``;
* piqa: ``"Question: {goal}\\nAnswer:"``, continuations ``" {sol1}"`` and ``" {sol2}"``.

Invariants. Task files come from outside and are parsed strictly: every problem is one
``GoodputError`` naming ``path:line``, what is wrong and the fix, never another exception. The
file must be a regular file (a FIFO is refused, never waited on); a line is read through
``io.read_lines`` (one longer than ``MAX_LINE_BYTES`` is refused, not loaded), must be UTF-8
holding one JSON object without duplicate keys or NaN/Infinity; an item has 2 to ``MAX_CHOICES``
choices, every text is a non-blank string of at most ``MAX_TEXT_CHARS`` characters that encodes
as UTF-8 (no unpaired surrogate escapes), and the answer is one of the choices. Blank lines are
skipped; a file with no item is refused. Hostile input costs linear time (the tag cleaning is a
linear scan, not a backtracking regex).

It does not download data sets, build few-shot prompts, shuffle or score (``harness`` scores).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from goodput.errors import GoodputError
from goodput.io import json_type_name, read_lines

MAX_LINE_BYTES = 1 << 20
MAX_CHOICES = 16
MAX_TEXT_CHARS = 1 << 16
# Keys quoted when a field is missing, and characters of a value quoted in an error.
MAX_KEYS_SHOWN = 12
MAX_QUOTED_CHARS = 40


@dataclass(frozen=True, slots=True)
class ChoiceItem:
    """One question: the model scores each of ``choices`` as the continuation of ``context``;
    ``choices[answer]`` is the right one. Continuations carry their leading space."""

    context: str
    choices: tuple[str, ...]
    answer: int


class _BadLine(Exception):
    """What is wrong with the line being read (and its fix, when not the layout's general one);
    ``read_choice_task`` adds ``path:line``."""

    def __init__(self, what: str, fix: str | None = None):
        super().__init__(what)
        self.what, self.fix = what, fix


def read_choice_task(
    path: str | os.PathLike[str], layout: str, limit: int | None = None
) -> list[ChoiceItem]:
    """The items of the JSONL file ``path`` in ``layout`` (a key of ``LAYOUTS``), in file order;
    the first ``limit`` only when given (the rest of the file is not read)."""
    path = Path(path)
    if layout not in LAYOUTS:
        raise GoodputError.usage(
            "layout", f"unknown layout {layout!r}", f"use one of: {', '.join(LAYOUTS)}"
        )
    if limit is not None and (type(limit) is not int or limit < 1):
        raise GoodputError.usage("limit", f"{limit!r} is not a positive count", "pass 1 or more")
    build, example = LAYOUTS[layout]
    items: list[ChoiceItem] = []
    fix = "an item is a few kilobytes at most; fix or remove the line"
    for line_number, line in read_lines(path, MAX_LINE_BYTES, fix=fix):
        if not line.strip():
            continue
        try:
            items.append(build(_parse(line)))
        except _BadLine as bad:
            fix = bad.fix or f"each {layout} line is an object like {example} (see docs/evals.md)"
            raise GoodputError(f"{path}:{line_number}", bad.what, fix) from None
        if len(items) == limit:
            break
    if not items:
        raise GoodputError(
            path, "holds no items", f"point at a {layout} JSONL file with one item per line"
        )
    return items


def _parse(line: bytes) -> dict[str, Any]:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _BadLine(
            f"invalid UTF-8 at byte {error.start} of the line", "re-encode the file as UTF-8"
        ) from None
    try:
        record = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        # Some of json's messages end in " at" ("Unterminated string starting at").
        reason = f"{error.msg.removesuffix(' at')} at column {error.colno}"
        raise _BadLine(f"malformed JSON: {reason}", "fix or remove the line") from None
    except ValueError as error:  # e.g. an integer past Python's digit limit
        reason = str(error).split(";")[0]  # its advice is for programmers
        raise _BadLine(f"unreadable JSON: {reason}", "fix or remove the line") from None
    except RecursionError:
        raise _BadLine("JSON nested too deeply", "fix or remove the line") from None
    if not isinstance(record, dict):
        raise _BadLine(f"expected a JSON object, got {json_type_name(record)}")
    return record


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    record = dict(pairs)
    if len(record) != len(pairs):
        # Which value a reader keeps differs between libraries: refuse rather than guess.
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _BadLine(f"key {_quote(key)} appears twice in one object")
            seen.add(key)
    return record


def _no_constant(name: str) -> Any:
    raise _BadLine(f"{name} is not valid JSON")


def _arc_item(record: dict[str, Any]) -> ChoiceItem:
    question = _field(record, "question")
    if isinstance(question, dict):  # AI2's own JSONL: choices nested in the question
        stem = _text(_field(question, "stem", "question.stem"), "question.stem")
        entries = _choices(_field(question, "choices", "question.choices"), "question.choices")
        texts, labels = [], []
        for index, entry in enumerate(entries):
            name = f"question.choices[{index}]"
            if not isinstance(entry, dict):
                raise _BadLine(f"{name} is {json_type_name(entry)}, not an object")
            texts.append(_text(_field(entry, "text", f"{name}.text"), f"{name}.text"))
            labels.append(_text(_field(entry, "label", f"{name}.label"), f"{name}.label"))
    elif isinstance(question, str):  # the Hugging Face export: parallel lists beside it
        stem = _text(question, "question")
        choices = _field(record, "choices")
        if not isinstance(choices, dict):
            raise _BadLine(f"'choices' is {json_type_name(choices)}, not an object")
        text_values = _choices(_field(choices, "text", "choices.text"), "choices.text")
        label_values = _choices(_field(choices, "label", "choices.label"), "choices.label")
        if len(text_values) != len(label_values):
            raise _BadLine(
                f"choices.text has {len(text_values)} entries but choices.label {len(label_values)}"
            )
        texts = [_text(value, f"choices.text[{i}]") for i, value in enumerate(text_values)]
        labels = [_text(value, f"choices.label[{i}]") for i, value in enumerate(label_values)]
    else:
        raise _BadLine(f"'question' is {json_type_name(question)}, not an object or a string")
    if len(set(labels)) != len(labels):
        raise _BadLine(f"the choice labels repeat: {_quote(labels)}")
    answer_key = _text(_field(record, "answerKey"), "answerKey")
    if answer_key not in labels:
        raise _BadLine(f"answerKey {_quote(answer_key)} is none of the labels {_quote(labels)}")
    context = f"Question: {stem}\nAnswer:"
    return ChoiceItem(context, tuple(f" {text}" for text in texts), labels.index(answer_key))


def _hellaswag_item(record: dict[str, Any]) -> ChoiceItem:
    if "ctx_a" in record:
        ctx_b = _text(record.get("ctx_b", ""), "ctx_b", allow_empty=True)
        # str.capitalize also lowercases the rest, as lm-eval's prompt does.
        ctx = _text(record["ctx_a"], "ctx_a") + " " + ctx_b.capitalize()
    else:
        ctx = _text(_field(record, "ctx"), "ctx")
    if "activity_label" in record:
        ctx = _text(record["activity_label"], "activity_label") + ": " + ctx
    context = _clean_wikihow(ctx)
    if not context.strip():
        raise _BadLine("the context is empty once its WikiHow [tags] are removed")
    endings = _choices(_field(record, "endings"), "endings")
    texts = []
    for index, ending in enumerate(endings):
        text = _clean_wikihow(_text(ending, f"endings[{index}]"))
        if not text.strip():
            raise _BadLine(f"endings[{index}] is empty once its WikiHow [tags] are removed")
        texts.append(text)
    answer = _index(_field(record, "label"), "label", len(texts))
    return ChoiceItem(context, tuple(f" {text}" for text in texts), answer)


def _piqa_item(record: dict[str, Any]) -> ChoiceItem:
    goal = _text(_field(record, "goal"), "goal")
    solutions = [_text(_field(record, name), name) for name in ("sol1", "sol2")]
    answer = _index(_field(record, "label"), "label", len(solutions))
    return ChoiceItem(f"Question: {goal}\nAnswer:", tuple(f" {text}" for text in solutions), answer)


# layout -> (item builder, a one-line example for error messages).
LAYOUTS: dict[str, tuple[Callable[[dict[str, Any]], ChoiceItem], str]] = {
    "arc": (
        _arc_item,
        '{"question": {"stem": "...", "choices": [{"text": "...", "label": "A"}, ...]}, '
        '"answerKey": "A"}',
    ),
    "hellaswag": (
        _hellaswag_item,
        '{"activity_label": "...", "ctx_a": "...", "ctx_b": "...", "endings": ["...", ...], '
        '"label": 0}',
    ),
    "piqa": (_piqa_item, '{"goal": "...", "sol1": "...", "sol2": "...", "label": 0}'),
}


def _field(record: dict[str, Any], key: str, name: str | None = None) -> Any:
    if key not in record:
        keys = ", ".join(_quote(k) for k in list(record)[:MAX_KEYS_SHOWN])
        more = f" and {len(record) - MAX_KEYS_SHOWN} more" if len(record) > MAX_KEYS_SHOWN else ""
        raise _BadLine(f"no {name or key!r} field; keys present: {keys or 'none'}{more}")
    return record[key]


def _text(value: Any, name: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise _BadLine(f"{name!r} is {json_type_name(value)}, not a string")
    if not allow_empty and not value.strip():
        raise _BadLine(f"{name!r} is empty")
    if len(value) > MAX_TEXT_CHARS:
        raise _BadLine(f"{name!r} is {len(value)} characters, more than {MAX_TEXT_CHARS}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _BadLine(f"{name!r} holds an unpaired surrogate escape (\\ud800-\\udfff)") from None
    return value


def _choices(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise _BadLine(f"{name!r} is {json_type_name(value)}, not an array")
    if not 2 <= len(value) <= MAX_CHOICES:
        raise _BadLine(f"{name!r} has {len(value)} entries; an item has 2 to {MAX_CHOICES} choices")
    return value


def _index(value: Any, name: str, num_choices: int) -> int:
    """A 0-based answer index, written as a number or a string of digits."""
    if type(value) is int:
        index = value
    elif isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 9:
        index = int(value)
    elif value == "":
        raise _BadLine(f"{name!r} is empty: the item has no answer", "use a split with answers")
    else:
        raise _BadLine(f"{name!r} is {_quote(value)}, not a choice index (0, 1, ...)")
    if not 0 <= index < num_choices:
        raise _BadLine(f"{name!r} {index} is out of range for {num_choices} choices (from 0)")
    return index


def _clean_wikihow(text: str) -> str:
    """HellaSwag's WikiHow items carry section tags ("[header]", "[step]", "[title]"): strip the
    text, turn " [title]" into ". ", drop every "[...]" that closes on its line, then fold one
    pass of double spaces — the cleaning lm-eval's hellaswag prompt applies."""
    text = text.strip().replace(" [title]", ". ")
    kept = []
    for line in text.split("\n"):
        start = 0
        # A tag is the first "[" up to the first "]" after it; the scan only moves forward.
        while (opening := line.find("[", start)) >= 0:
            closing = line.find("]", opening + 1)
            if closing < 0:
                break
            kept.append(line[start:opening])
            start = closing + 1
        kept.append(line[start:])
        kept.append("\n")
    return "".join(kept[:-1]).replace("  ", " ")


def _quote(value: Any) -> str:
    """``value`` as JSON, cut to ``MAX_QUOTED_CHARS``: errors quote outside data, so bounded."""
    quoted = json.dumps(value, ensure_ascii=True)
    return quoted if len(quoted) <= MAX_QUOTED_CHARS else quoted[: MAX_QUOTED_CHARS - 3] + "..."
