"""The orchestration part: where ranks run and how they are placed, watched and retried.

``run(LaunchOptions(command=[...], ...))`` is ``goodput launch`` as a Python call (``run.py``).
Runs on login nodes and inside watchdogs, so nothing in this package imports torch, nor
``goodput.train`` or ``goodput.checkpoint`` (tests/unit/core/test_import_direction.py).
"""

from goodput.launch.run import LaunchOptions, run

__all__ = ["LaunchOptions", "run"]
