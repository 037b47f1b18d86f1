"""Local lm-eval task files over small data sets in the words of ``tiny.TOKENIZED_WORDS``, so the
tiny tokenized run reads them in few tokens: shared by the tests and benchmarks of ``goodput
eval``. Every task reads a JSONL file by absolute path (``dataset_path: json``): offline.

* ``write_choice_task``: ARC-like multiple choice in the Hugging Face export layout, prompted
  as lm-eval's ``arc_easy`` prompts (and as ``choice_tasks``' ``arc`` layout reads the same file);
  every tenth question is long, past the tiny model's 64 positions, so left truncation shows.
* ``write_rolling_task``: ``loglikelihood_rolling`` over documents, some longer than one window.
* ``write_generation_task``: ``generate_until`` with a stop string and a few new tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from goodput.testing.tiny import TOKENIZED_WORDS

CHOICE_TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
doc_to_choice: "{{{{choices.text}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

ROLLING_TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""

GENERATION_TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until:
    - "{stop}"
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(TOKENIZED_WORDS) for _ in range(rng.randint(low, high)))


def write_choice_task(
    directory: Path, name: str = "tiny_arc", num_items: int = 40, seed: int = 0
) -> Path:
    """``directory/{name}.yaml`` over ``directory/{name}.jsonl``; return the YAML's path."""
    rng = random.Random(seed)
    lines = []
    for index in range(num_items):
        question = _words(rng, 40, 60) if index % 10 == 9 else _words(rng, 2, 12)
        labels = list("ABCDE"[: rng.randint(2, 4)])
        texts = [_words(rng, 1, 3) for _ in labels]
        item = {
            "id": f"{name}-{index}",
            "question": question,
            "choices": {"text": texts, "label": labels},
            "answerKey": rng.choice(labels),
        }
        lines.append(json.dumps(item) + "\n")
    return _write(directory, name, CHOICE_TASK, lines)


def write_rolling_task(
    directory: Path, name: str = "tiny_text", num_docs: int = 6, seed: int = 1
) -> Path:
    """Documents of 1 to ~80 words (the long ones span several 64-token windows)."""
    rng = random.Random(seed)
    lengths = [1, 5, 80, 30, 60, 12][:num_docs] + [rng.randint(1, 80) for _ in range(num_docs - 6)]
    lines = [json.dumps({"text": _words(rng, length, length)}) + "\n" for length in lengths]
    return _write(directory, name, ROLLING_TASK, lines)


def write_generation_task(
    directory: Path,
    name: str = "tiny_generate",
    num_docs: int = 5,
    seed: int = 2,
    stop: str = " beta",
    max_gen_toks: int = 12,
) -> Path:
    """Prompts of a few words; generation stops at ``stop`` or after ``max_gen_toks``."""
    rng = random.Random(seed)
    lines = [
        json.dumps({"prompt": _words(rng, 1, 6), "answer": _words(rng, 1, 2)}) + "\n"
        for _ in range(num_docs)
    ]
    return _write(directory, name, GENERATION_TASK, lines, stop=stop, max_gen_toks=max_gen_toks)


def _write(directory: Path, name: str, template: str, lines: list[str], **fields: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{name}.jsonl"
    data.write_text("".join(lines))
    task = directory / f"{name}.yaml"
    task.write_text(template.format(name=name, data=json.dumps(str(data.resolve())), **fields))
    return task
