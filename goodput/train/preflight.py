"""What ``goodput train`` refuses before its first step, checked by a command that starts training
as child processes, before it writes or starts anything.

``goodput chaos`` launches ``goodput train`` twice; a config the trainer refuses must be refused
by the campaign first, not after it has written its folder and started the straight run. The
config is loaded by ``config.load_config`` (what ``goodput train`` calls); ``check_launchable``
then runs, without a process group, the trainer's own checks that need the launch: the layout on
the world size (``resolve_degrees``, ``check_tp_within_hosts``: what ``build_mesh`` checks), the
batch plan (``plan_batches``) and the pipeline's micro-batches, the metrics sinks, and the
blend, built or found as rank 0 builds it (``build.blend_spec``: a cache, which the runs then
find) with its tokenizer checked against the model (``build.check_tokenizer_fits``).

It does not build the model or read checkpoints: those refusals need the ranks.
"""

from __future__ import annotations

import contextlib
import sys

from goodput.data.blend import build_blend
from goodput.train.build import blend_spec, check_tokenizer_fits
from goodput.train.config import RunConfig, plan_batches
from goodput.train.parallel_config import check_tp_within_hosts, resolve_degrees
from goodput.train.pipeline import pipeline_microbatches


def check_launchable(cfg: RunConfig, num_ranks: int, ranks_per_host: int) -> None:
    """Refuse ``cfg`` as ``goodput train`` on ``num_ranks`` ranks (``ranks_per_host`` to a host)
    would before its first step; the blend's report goes to stderr."""
    degrees = resolve_degrees(cfg.parallel, num_ranks)
    check_tp_within_hosts(degrees.tp, num_ranks, ranks_per_host)
    plan = plan_batches(cfg.train, dp_size=degrees.dp)
    if degrees.pp > 1:
        pipeline_microbatches(cfg.parallel, plan.local_batch_size, plan.grad_accumulation)
    cfg.metrics.check_sinks()
    with contextlib.redirect_stdout(sys.stderr):
        _, manifest = build_blend(blend_spec(cfg, plan))
    check_tokenizer_fits(cfg, manifest)
