"""The orchestration part: where ranks run and how they are placed, watched and retried.

``run(LaunchOptions(command=[...], ...))`` is ``goodput launch`` as a Python call (``run.py``).
Runs on login nodes and inside watchdogs, so nothing in this package imports torch at module
level (a test imports every module in a fresh interpreter); ``device`` imports it inside its
functions.
"""

from goodput.launch.run import LaunchOptions, run

__all__ = ["LaunchOptions", "run"]
