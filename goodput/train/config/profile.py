"""The ``[profile]`` table: which steps torch.profiler traces, and whether the CUDA allocator's
history is kept for a memory snapshot on an out-of-memory error (torch's "memory snapshot": the
allocator's dump, ``train/profiling.py``). Torch-free, like every table here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from goodput.config import limits
from goodput.errors import GoodputError

# A trace grows with every op of every step: a few MB a step for a small model, far more for a
# big one, and the viewers slow down past a few hundred MB. Profile a few steps, not an epoch.
MAX_STEPS = 100


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfilerConfig:
    # [first, last] training steps to trace, both included; None: no trace
    steps: tuple[int, int] | None = field(default=None, metadata=limits(at_least=1))
    # CUDA: keep the allocator's history and dump it when an allocation fails
    memory_snapshot_on_oom: bool = False

    def __post_init__(self) -> None:
        if self.steps is None:
            return
        first, last = self.steps
        if first > last:
            raise GoodputError.usage(
                "[profile]",
                f"steps [{first}, {last}] end before they start",
                f"write the first step first: steps = [{last}, {first}]",
            )
        if last - first >= MAX_STEPS:
            raise GoodputError.usage(
                "[profile]",
                f"steps [{first}, {last}] are {last - first + 1} steps; at most {MAX_STEPS} are "
                "traced (a trace grows with every step)",
                f"trace a few steps, e.g. steps = [{first}, {first + 4}]",
            )

    @property
    def enabled(self) -> bool:
        return self.steps is not None or self.memory_snapshot_on_oom
