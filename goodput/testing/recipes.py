"""The shipped recipes (``configs/`` but the CPU demo) and the machine each one's ``# Machine:``
line names: shared by the tests that hold each recipe to its machine and the benchmarks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from goodput.testing.jobs import REPO

RECIPES = sorted(path for path in (REPO / "configs").glob("*.toml") if path.stem != "tiny-cpu")
MACHINE = re.compile(
    r"^# Machine: (?P<nodes>[\d,]+) nodes? x (?P<per_node>\d+) (?:GPUs|tiles) of (?P<gb>\d+) GB",
    re.M,
)


@dataclass(frozen=True, slots=True)
class RecipeMachine:
    nhosts: int
    ppn: int  # devices per host
    gpu_mem_gb: int

    def plan_options(self) -> list[str]:
        """The machine as ``goodput plan layout`` takes it."""
        return ["--nhosts", str(self.nhosts), "--ppn", str(self.ppn)] + [
            "--gpu-mem-gb",
            str(self.gpu_mem_gb),
        ]


def recipe_machine(path: Path) -> RecipeMachine:
    """The machine of the recipe at ``path``'s ``# Machine:`` line."""
    found = MACHINE.search(path.read_text())
    assert found, f"{path.name}: no '# Machine: N nodes x G GPUs|tiles of M GB' line"
    return RecipeMachine(
        int(found["nodes"].replace(",", "")), int(found["per_node"]), int(found["gb"])
    )
