"""Fuzz tests: every parser of outside input, fed by hypothesis.

The property is always the same: a valid result or a ``GoodputError``, never another exception,
a hang or unbounded memory. CI runs a small fixed budget per test (``ci`` profile, 60 examples,
derandomized so a red run replays); ``GOODPUT_FUZZ_EXAMPLES=N`` runs N examples a test with
fresh randomness, for a longer campaign by hand.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_examples = os.environ.get("GOODPUT_FUZZ_EXAMPLES")
settings.register_profile(
    "goodput",
    max_examples=int(_examples) if _examples else 60,
    derandomize=not _examples,
    deadline=None,  # shared CI machines are noisy; hangs are caught by pytest-timeout instead
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)
settings.load_profile("goodput")
