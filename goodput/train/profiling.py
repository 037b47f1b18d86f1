"""The ``[profile]`` table and the profiler it turns on: why a run is slow, step by step.

``steps = [a, b]`` traces steps a through b (at most ``MAX_STEPS``) with ``torch.profiler``:
CPU activities, plus CUDA where a GPU is present. When step b ends, each rank writes one Chrome
trace, ``RUN/profile/rank-00003.steps-5-7.pt.trace.json`` (``rundir.profile_trace``), atomically:
Perfetto (ui.perfetto.dev) opens it, and TensorBoard's profiler plugin lists that suffix. Each
step of the window is a ``ProfilerStep#N`` span named by its training step, so the spans of
every rank line up. On a resume the window's steps already past are said in one line and not
recorded; steps past the run's last are never reached, and that is said too.

``memory_snapshot_on_oom = true`` (CUDA only) keeps the allocator's history for the whole run
and, when an allocation fails, writes ``RUN/profile/oom-rank-00003.pickle``
(``torch.cuda.memory._dump_snapshot``'s format, for pytorch.org/memory_viz). goodput writes that
file and never reads it (nothing from disk is unpickled). This path has not been run here: the
machines that built it have no GPU.

Off (the default), ``build_profiler`` returns None: the loop holds None and calls nothing, so
no profiler is ever started and a run without ``[profile]`` costs nothing. (``import torch``
itself loads the ``torch.profiler`` module; what costs is a started trace.) This module imports
no torch at load time: the config is read by commands that never load torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from goodput import rundir
from goodput.errors import from_exception
from goodput.io import atomic_path
from goodput.progress import print_line
from goodput.train.config.profile import ProfilerConfig

STEP_SPAN = "ProfilerStep#"  # torch.profiler's name for a step's span, which both viewers read
MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept (torch's own example uses this)


def build_profiler(
    config: ProfilerConfig, run_dir: Path, *, rank: int, first_step: int, last_step: int
) -> Profiler | None:
    """The profiler of this rank for steps ``first_step`` (after a resume, the one after the
    checkpoint's) to ``last_step``; None when ``[profile]`` asks for nothing that can happen
    here. Only rank 0 says what is skipped, once for the run."""
    if not config.enabled:
        return None
    window = _window(config.steps, first_step, last_step, say=rank == 0)
    snapshot = config.memory_snapshot_on_oom and _cuda_available(say=rank == 0)
    if window is None and not snapshot:
        return None
    return Profiler(run_dir, rank=rank, window=window, memory_snapshot_on_oom=snapshot)


def _window(
    steps: tuple[int, int] | None, first_step: int, last_step: int, *, say: bool
) -> tuple[int, int] | None:
    """The part of ``steps`` this process will run, saying in one line what it will not."""
    if steps is None:
        return None
    first, last = max(steps[0], first_step), min(steps[1], last_step)
    if say and (first, last) != steps:
        print_line(f"profile: {_missed(steps, first_step, last_step)}; {_plan(first, last)}")
    return (first, last) if first <= last else None


def _missed(steps: tuple[int, int], first_step: int, last_step: int) -> str:
    parts = []
    if steps[0] < first_step:
        parts.append(f"this start resumes at step {first_step}")
    if steps[1] > last_step:
        parts.append(f"the run ends at step {last_step}")
    return f"steps [{steps[0]}, {steps[1]}]: " + " and ".join(parts)


def _plan(first: int, last: int) -> str:
    return f"tracing steps {first}-{last}" if first <= last else "nothing is recorded"


def _cuda_available(*, say: bool) -> bool:
    import torch  # the trainer has loaded it already; this module is read without it

    if torch.cuda.is_available():
        return True
    if say:
        print_line("profile: memory_snapshot_on_oom needs a CUDA device; nothing is recorded")
    return False


class Profiler:
    """One rank's trace of the steps of ``window`` and its out-of-memory snapshot.

    The loop calls ``before_step(step)`` at the top of every step, ``after_step(step)`` at its
    end and ``close()`` once the loop is left; steps outside the window cost a comparison. A
    window cut short (the run stopped inside it) is written by ``close()``, named by the last
    step begun, whose span ends at the close."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        window: tuple[int, int] | None,
        memory_snapshot_on_oom: bool,
    ) -> None:
        self.run_dir, self.rank, self.window = run_dir, rank, window
        self._trace: Any = None  # torch.profiler.profile while tracing
        self._span: Any = None  # the record_function of the step being traced
        self._last_begun: int | None = None  # the last step traced, which names the file
        self._memory_history = memory_snapshot_on_oom
        if memory_snapshot_on_oom:
            _watch_out_of_memory(rundir.oom_snapshot(run_dir, rank))

    def before_step(self, step: int) -> None:
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            return
        if self._trace is None:
            self._trace = _start_trace()
        from torch import profiler

        self._span = profiler.record_function(f"{STEP_SPAN}{step}")
        self._span.__enter__()
        self._last_begun = step

    def after_step(self, step: int) -> None:
        if self._span is None:
            return
        self._span.__exit__(None, None, None)
        self._span = None
        if self.window is not None and step == self.window[1]:
            self._write_trace()

    def close(self) -> None:
        """Write a window cut short, stop tracing, and stop keeping the allocator's history."""
        if self._span is not None:  # the step the run stopped in: its span ends here
            self._span.__exit__(None, None, None)
            self._span = None
        if self._trace is not None:
            self._write_trace()
        if self._memory_history:
            import torch

            torch.cuda.memory._record_memory_history(enabled=None)
            self._memory_history = False

    def _write_trace(self) -> None:
        trace, self._trace = self._trace, None
        trace.stop()
        assert self.window is not None and self._last_begun is not None  # a trace was begun
        path = rundir.profile_trace(self.run_dir, self.rank, self.window[0], self._last_begun)
        with atomic_path(path) as tmp:
            trace.export_chrome_trace(str(tmp))  # the temp name ends in .tmp: never gzipped
        if self.rank == 0:
            print_line(f"profile: steps {self.window[0]}-{self._last_begun} traced: {path}")


def _start_trace() -> Any:
    import torch
    from torch import profiler

    activities = [profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(profiler.ProfilerActivity.CUDA)
    trace = profiler.profile(activities=activities)
    trace.start()
    return trace


def _watch_out_of_memory(path: Path) -> None:
    """Keep the CUDA allocator's history from now on and dump it to ``path`` when an
    allocation fails (torch's observer runs before the OutOfMemoryError is raised). Needs a
    GPU; not run on the machines this was built on."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    def dump(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        try:
            with atomic_path(path) as tmp:
                torch.cuda.memory._dump_snapshot(str(tmp))
        # Whatever fails here, the out-of-memory error that follows is the one to see: a
        # failed dump is one line beside it, never an error of its own.
        except Exception as exc:
            print(f"profile: {from_exception(exc).render()}", file=sys.stderr, flush=True)

    torch._C._cuda_attach_out_of_memory_observer(dump)  # type: ignore[attr-defined]  # CUDA only
