"""The shell lines the README and docs/ show, as the tests that run them read them."""

from __future__ import annotations

import re

FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def command_lines(text: str, languages: tuple[str, ...] | None = None) -> list[str]:
    """The shell lines of the fenced blocks of ``text`` (of ``languages`` only, when given),
    continuations joined, comments cut."""
    lines = []
    for language, body in FENCE.findall(text):
        if languages is not None and language not in languages:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                lines.append(line.split(" # ")[0].strip())
    return lines
