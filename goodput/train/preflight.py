"""What ``goodput train`` refuses before its first step, checked by a command that starts training
as child processes, before it writes or starts anything.

``goodput chaos`` launches ``goodput train`` twice; a config the trainer refuses must be refused
by the campaign first, not after it has written its folder and started the straight run. The
config is loaded by ``config.load_config`` (what ``goodput train`` calls); ``check_launchable``
then runs, without a process group, the trainer's own checks that need the launch: the layout on
the world size, the batch plan and the pipeline's micro-batches (``config.check_world``), the
metrics sinks, and the blend, built or found as rank 0 builds it (``build.blend_spec``: a cache,
which the runs then find) with its tokenizer checked against the model
(``build.check_tokenizer_fits``).

It does not build the model or read checkpoints: those refusals need the ranks.
"""

from __future__ import annotations

import contextlib
import sys

from goodput.data.blend import build_blend
from goodput.train.build import blend_spec, check_tokenizer_fits
from goodput.train.config.run import RunConfig, check_world


def check_launchable(cfg: RunConfig, num_ranks: int, ranks_per_host: int) -> None:
    """Refuse ``cfg`` as ``goodput train`` on ``num_ranks`` ranks (``ranks_per_host`` to a host)
    would before its first step; the blend's report goes to stderr."""
    plan = check_world(cfg, num_ranks, ranks_per_host)
    cfg.metrics.check_sinks()
    with contextlib.redirect_stdout(sys.stderr):
        _, manifest = build_blend(blend_spec(cfg, plan))
    check_tokenizer_fits(cfg, manifest)
